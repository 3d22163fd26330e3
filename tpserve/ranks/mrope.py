"""Multimodal rotary positions (Qwen2.5-VL's mrope): every text position is three, (t, h, w).

A text token's three are equal; an image's tokens take (start, start + row, start + column) over
its merged grid, and the text after it continues from start + max(rows, columns) (transformers'
get_rope_index). A video's frame (temporal patch) f takes t = start + int(f * interval), where
interval = tokens_per_second * the seconds one temporal patch spans, in float32 as transformers
multiplies it; the text after a video continues from start + max(rows, columns) too. The rotary
frequencies are split into mrope_section runs (t, h, w), or interleaved (Qwen3-VL), and each is turned
by its own axis, in both halves of the head.

Rank 0 works out a prompt's positions (`prompt_positions`) and sends them with its spans
(tpserve/ranks/wire_spans.py Span.rope): the followers never see the images. After a prompt every position is
its KV position plus the lane's delta (the prompt's largest position + 1 - its length, as
transformers' rope deltas: a video's last time position may pass the text after it), which rank 0
sends after each span's positions and each rank keeps per lane (tpserve/ranks/engine.py): decode steps
travel as they always have.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tpserve.kernels.rotary import Rotary


def media_positions(start: int, grid: tuple[int, int], frames: int = 1, interval: float = 1.0):
    """The (t, h, w) lists of one image's (or video's) merged grid (rows, columns) from `start`."""
    rows, cols = grid
    t, h, w = [], [], []
    for frame in range(frames):
        time = int(np.float32(frame) * np.float32(interval))  # float32, then truncated, as transformers
        for row in range(rows):
            for col in range(cols):
                t.append(start + time)
                h.append(start + row)
                w.append(start + col)
    return t, h, w


def prompt_positions(length: int, media: Sequence[tuple]) -> list[list[int]]:
    """A prompt's [t, h, w] position lists. media: (offset, merged (rows, columns)) per image, or
    (offset, (rows, columns), frames, interval) per video, in prompt order, each taking
    frames * rows * columns tokens from its offset."""
    axes: list[list[int]] = [[], [], []]
    at = position = 0
    for offset, (rows, cols), *time in media:
        frames, interval = time or (1, 1.0)
        for axis in axes:
            axis.extend(range(position, position + offset - at))
        position += offset - at
        for axis, values in zip(axes, media_positions(position, (rows, cols), frames, interval)):
            axis.extend(values)
        position += max(rows, cols)
        at = offset + frames * rows * cols
    for axis in axes:
        axis.extend(range(position, position + length - at))
    return axes


def span_rope(axes: list[list[int]], start: int, end: int) -> tuple[int, ...]:
    """Positions start..end-1 of a prompt's [t, h, w] lists as a Span carries them: the t's, then
    the h's, then the w's, then the lane's delta after them (the largest position up to `end` + 1
    - end)."""
    delta = max(max(axis[:end]) for axis in axes) + 1 - end
    return (*(p for axis in axes for p in axis[start:end]), delta)


def chunk_rope(images, start: int, num_tokens: int, prompt_length: int = 0) -> tuple[int, ...]:
    """A prompt chunk's rope positions and delta as a Span carries them (span_rope), for the
    prompt's images (offset, num_tokens, grid: merged (rows, columns), frames, interval, in prompt
    order); () where no image has a grid (a 1-D rotary, or a prompt without images). Tokens past
    `prompt_length` (a resumed reply's) sit where its decode steps put them: their KV position plus
    the prompt's delta."""
    media = [
        (image.offset, image.grid, image.frames, image.interval) for image in images if image.grid is not None
    ]
    if not media:
        return ()
    end = start + num_tokens
    length = min(prompt_length or end, end)
    axes = prompt_positions(length, media)
    delta = max(max(axis) for axis in axes) + 1 - length
    for axis in axes:
        axis.extend(range(length + delta, end + delta))
    return span_rope(axes, start, end)


def section_axes(section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Which axis (0 t, 1 h, 2 w) turns each of the rotary's sum(section) frequencies: runs of
    section[0] t's, then h's, then w's (Qwen2.5-VL), or interleaved t, h, w, t, h, w, ... while each of
    h and w has frequencies left, then t (Qwen3-VL)."""
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
    column = torch.arange(sum(section))
    axis = torch.zeros_like(column)
    for index in (1, 2):
        axis[(column % 3 == index) & (column < 3 * section[index])] = index
    return axis


class MRotary(Rotary):
    """The tables of Rotary, read per axis: positions [3, T] (t, h, w) or [T] (all three equal)."""

    def __init__(self, section: Sequence[int], *args, interleaved: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        half = self.cos.shape[-1] // 2
        rotating = (kwargs.get("rotary_dim") or 2 * half) // 2
        if sum(section) != rotating:
            raise ValueError(
                f"mrope_section {list(section)} does not sum to the rotary's {rotating} frequencies"
            )
        # A partial rotary's resting columns (cos 1, sin 0 at every position) read axis t.
        axis = torch.cat([section_axes(section, interleaved), torch.zeros(half - rotating, dtype=torch.long)])
        self.axis = torch.cat([axis, axis]).to(self.cos.device)  # which axis turns each column

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().tables(positions, dtype)
        half = self.cos.shape[-1] // 2
        columns = torch.arange(self.axis.numel(), device=self.cos.device)
        picked = positions[self.axis].T  # [T, D]: each column's own axis position
        # Row-major copies: the native kernels read the tables' memory as [T, D].
        cos = self.cos[picked, columns].unsqueeze(1).to(dtype).contiguous()
        sin = self.sin[picked, columns].unsqueeze(1).to(dtype).contiguous()
        sin[..., :half] = -sin[..., :half]
        return cos, sin

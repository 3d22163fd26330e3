"""A decoded video -> the patches, grid and frame times a Qwen3-VL tower and prompt read, as transformers'
Qwen3VLVideoProcessor and Qwen3VLProcessor prepare them.

Frames are sampled by the processor's fps policy (`sample_frames`): int(frames / file fps * fps)
frames (fps 2 where the config names none), at least min_frames, at most max_frames and the file's
own count, picked evenly with the ends kept (numpy's linspace, rounded). The frames share one size:
the smart resize over the whole clip (the pixel bounds count every sampled frame, as transformers'
temporal smart_resize does; its per-frame cap is off, transformers' default), then each frame is
resized with Pillow's bicubic (transformers resizes video frames with torchvision, whose bicubic
rounds a little differently), rescaled and normalised. Every temporal_patch_size frames make one
temporal patch (the last frame repeated to fill the last); each patch is put in the prompt on its own,
after the text "<{seconds:.1f} seconds>": the mean of its first and last frame's times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tpserve.server.qwen_images import MAX_ASPECT
from tpserve.server.qwen_videos import VideoSampling
from tpserve.server.validation import invalid_argument
from tpserve.server.videos import VideoHeader

MIN_FRAMES, MAX_FRAMES = 4, 768  # Qwen3VLVideoProcessor's
MIN_PIXELS, MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32  # its size: pixels over all sampled frames


def clip_smart_resize(
    num_frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) of every frame: whole multiples of `factor`, the clip's pixels (frames rounded to
    whole temporal patches, times each frame's) within bounds; transformers' rule, rounding included."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise invalid_argument(
            f"a video of {width}x{height} is more than {MAX_ASPECT} times as long as it is wide"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen3VideoPlan:
    indices: tuple[int, ...]  # the frames sampled
    size: tuple[int, int]  # (height, width) every frame is resized to
    grid: tuple[int, int, int]  # (t, grid_h, grid_w) in patches
    seconds: tuple[float, ...]  # each temporal patch's time, as its text says it


@dataclass(frozen=True)
class Qwen3VideoPreprocessor(VideoSampling):
    PIXELS: ClassVar[tuple[int, int]] = (MIN_PIXELS, MAX_PIXELS)  # over the clip, not per frame
    FRAMES: ClassVar[tuple[int, int]] = (MIN_FRAMES, MAX_FRAMES)

    def plan(self, header: VideoHeader, where: str) -> Qwen3VideoPlan:
        """Which frames to decode, their size, the grid and the patches' times, from the header alone."""
        total, patch = header.num_frames, self.frames.temporal_patch_size
        count = int(total / header.fps * self.fps)
        count = min(max(count, self.min_frames), self.max_frames, total)
        if count < patch:
            raise invalid_argument(f"{where}.media is a video of {total} frames; the fewest read is {patch}")
        indices = tuple(np.linspace(0, total - 1, count).round().astype(int).tolist())
        factor = self.frames.patch_size * self.frames.merge_size
        pre = self.frames
        size = clip_smart_resize(
            count, header.height, header.width, patch, factor, pre.min_pixels, pre.max_pixels
        )
        padded = list(indices) + [indices[-1]] * (-count % patch)
        times = [index / header.fps for index in padded]
        seconds = tuple((times[i] + times[i + patch - 1]) / 2 for i in range(0, len(times), patch))
        grid = (len(padded) // patch, size[0] // pre.patch_size, size[1] // pre.patch_size)
        return Qwen3VideoPlan(indices, size, grid, seconds)

    def expansion(
        self,
        plan: Qwen3VideoPlan,
        config,
        encode_text: Callable[[str], list[int]],
        ids: Sequence[int],
        index: int,
    ) -> tuple[int, int, list[int], list[int]]:
        """The template's video pad at ids[index] -> the span of ids it replaces (the template's vision
        start and end around it too, as Qwen3VLProcessor collapses them), its tokens and where each
        patch's pads start among them."""
        start_id, end_id = config.vision_start_token_id, config.vision_end_token_id
        tokens, starts = timed_frames(
            plan, config.spatial_merge_size, encode_text, start_id, config.video_token_id, end_id
        )
        wrapped = 0 < index < len(ids) - 1 and ids[index - 1] == start_id and ids[index + 1] == end_id
        first, last = (index - 1, index + 2) if wrapped else (index, index + 1)
        return first, last, tokens, starts

    def patches(self, frames: list[np.ndarray]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Prepared frames (each [3, H, W]) -> patches [t * gh * gw, 3 * T * P * P] and the grid (t, gh, gw)."""
        frames = list(frames)
        frames += [frames[-1]] * (-len(frames) % self.frames.temporal_patch_size)
        return self.frames.patchify(np.stack(frames))


def timed_frames(
    plan: Qwen3VideoPlan,
    merge: int,
    encode_text: Callable[[str], list[int]],
    start_id: int,
    pad_id: int,
    end_id: int,
) -> tuple[list[int], list[int]]:
    """A video's tokens as Qwen3VLProcessor writes them in place of the template's one (its own
    vision start and end around it): per temporal patch, its time in text, then the vision start, a pad
    per merged grid position and the vision end; and where each patch's pads start among them."""
    per_patch = (plan.grid[1] // merge) * (plan.grid[2] // merge)
    tokens, starts = [], []
    for seconds in plan.seconds:
        tokens += [*encode_text(f"<{seconds:.1f} seconds>"), start_id]
        starts.append(len(tokens))
        tokens += [pad_id] * per_patch + [end_id]
    return tokens, starts

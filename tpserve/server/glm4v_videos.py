"""A decoded video -> the patches, grid and frame times a GLM-4.1V (or GLM-4.5V) tower and prompt read,
as transformers' Glm4vVideoProcessor and Glm4vProcessor prepare them.

Frames are sampled by the processor's `sample_frames`: for a clip of at most max_duration seconds
(300), floor(seconds * fps) frames (fps 2 where the config names none), frame i at ceil(i * file fps /
fps); a longer clip, max_duration * fps frames at evenly spaced times; repeats dropped, and the last
frame repeated where their count is odd. The frames share one size, the clip's smart resize (its pixel
bounds count every sampled frame: tpserve/server/qwen3_videos.py clip_smart_resize, the same rule),
each resized with Pillow's bicubic (transformers resizes video frames with torchvision, whose bicubic
rounds a little differently), rescaled and normalised. Every two frames make one temporal patch; each
patch is put in the prompt on its own, as an image (its begin and end of image, an image token per
merged grid position), then its first frame's time in whole seconds, as text; the template's begin and
end of video stay around them all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

import numpy as np

from tpserve.server.processor_config import video_processor_settings
from tpserve.server.qwen3_videos import Qwen3VideoPlan, Qwen3VideoPreprocessor, clip_smart_resize
from tpserve.server.videos import VideoHeader

MAX_DURATION = 300  # Glm4vVideoProcessor's: longer clips are sampled at evenly spaced times
MIN_PIXELS, MAX_PIXELS = 112 * 112, 28 * 28 * 2 * 30000  # its size: pixels over all sampled frames


@dataclass(frozen=True)
class Glm4vVideoPreprocessor(Qwen3VideoPreprocessor):
    PIXELS: ClassVar[tuple[int, int]] = (MIN_PIXELS, MAX_PIXELS)
    max_duration: float = MAX_DURATION

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Self:
        raw, _ = video_processor_settings(model_dir)
        sampling = super().from_model_dir(model_dir)
        return dataclasses.replace(sampling, max_duration=float(raw.get("max_duration", MAX_DURATION)))

    def plan(self, header: VideoHeader, where: str) -> Qwen3VideoPlan:
        """Which frames to decode (each once), their size, the grid and the patches' times, from the
        header alone."""
        total, file_fps, last = header.num_frames, header.fps, header.num_frames - 1
        duration = total / file_fps  # as transformers' PyAV reader says it
        if duration <= self.max_duration:
            count = max(math.floor(duration * self.fps), 1)
            picked = [min(last, math.ceil(i * file_fps / self.fps)) for i in range(count)]
        elif int(self.max_duration * self.fps) >= total:
            picked = list(range(total))
        else:
            times = np.linspace(0, duration, int(self.max_duration * self.fps), endpoint=True)
            picked = [min(last, math.ceil(t * file_fps)) for t in times]
        indices = tuple(dict.fromkeys(picked))  # repeats dropped, in order
        padded = [*indices, indices[-1]] if len(indices) % 2 else list(indices)
        pre, patch = self.frames, self.frames.temporal_patch_size
        factor = pre.patch_size * pre.merge_size
        size = clip_smart_resize(
            len(padded), header.height, header.width, patch, factor, pre.min_pixels, pre.max_pixels
        )
        seconds = tuple(index / file_fps for index in padded[::2])  # Glm4vProcessor: timestamps[::2]
        num_patches = -(-len(padded) // patch)
        seconds = (seconds + (seconds[-1],) * num_patches)[:num_patches]
        grid = (num_patches, size[0] // pre.patch_size, size[1] // pre.patch_size)
        return Qwen3VideoPlan(indices, size, grid, seconds)

    def expansion(
        self,
        plan: Qwen3VideoPlan,
        config,
        encode_text: Callable[[str], list[int]],
        ids: Sequence[int],
        index: int,
    ) -> tuple[int, int, list[int], list[int]]:
        """The template's video token at ids[index] -> the span it replaces (itself: the begin and end of
        video stay), its tokens as Glm4vProcessor writes them and where each patch's image tokens start."""
        per_patch = (plan.grid[1] // config.spatial_merge_size) * (plan.grid[2] // config.spatial_merge_size)
        tokens, starts = [], []
        for seconds in plan.seconds:
            tokens.append(config.image_start_token_id)
            starts.append(len(tokens))
            tokens += [config.image_token_id] * per_patch + [config.image_end_token_id]
            tokens += encode_text(str(int(seconds)))
        return index, index + 1, tokens, starts

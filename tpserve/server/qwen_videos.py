"""A decoded video -> the patches, grid and time step a Qwen2.5-VL tower and rotary read, as
transformers' Qwen2VLVideoProcessor and Qwen2_5_VLProcessor prepare them.

Frames are sampled by the processor's fps policy (`sample_frames`): `fps` frames a second (2 where the
config names none, as qwen-vl-utils and vLLM sample), at least min_frames, at most max_frames and the
file's own count, rounded down to whole temporal patches, then picked evenly
(torch.arange(0, total, total / count)). Each frame is resized as an image is (tpserve/server/qwen_images.py:
the smart resize, Pillow's bicubic; transformers resizes video frames with torchvision, whose bicubic
rounds a little differently), rescaled and normalised; every temporal_patch_size frames make one
temporal patch (the last frame repeated to fill the last), and the time one patch spans is
temporal_patch_size / the sampled fps (the processor's second_per_grid_ts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

import numpy as np
import torch

from tpserve.server.processor_config import video_processor_settings
from tpserve.server.qwen_images import QwenPreprocessor
from tpserve.server.validation import invalid_argument
from tpserve.server.videos import VideoHeader

DEFAULT_FPS = 2.0
MIN_FRAMES, MAX_FRAMES = 4, 768  # Qwen2VLVideoProcessor's
MIN_PIXELS, MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768  # Qwen2VLVideoProcessor's size, per frame


@dataclass(frozen=True)
class VideoPlan:
    indices: tuple[int, ...]  # the frames sampled
    grid: tuple[int, int, int]  # (t, grid_h, grid_w) in patches
    seconds_per_grid: float  # the time one temporal patch spans


@dataclass(frozen=True)
class VideoSampling:
    """A Qwen-VL video processor's settings; each family's class says how it samples (`plan`)."""

    frames: QwenPreprocessor  # each frame's resize and values, and the patch layout
    fps: float
    min_frames: int
    max_frames: int
    PIXELS: ClassVar[tuple[int, int]] = (MIN_PIXELS, MAX_PIXELS)  # the processor's size defaults
    FRAMES: ClassVar[tuple[int, int]] = (MIN_FRAMES, MAX_FRAMES)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Self:
        raw, _ = video_processor_settings(model_dir)  # tpserve/server/processor_config.py says which file
        return cls(
            frames=QwenPreprocessor.from_settings(raw, *cls.PIXELS),
            fps=float(raw.get("fps") or DEFAULT_FPS),
            min_frames=int(raw.get("min_frames", cls.FRAMES[0])),
            max_frames=int(raw.get("max_frames", cls.FRAMES[1])),
        )


@dataclass(frozen=True)
class QwenVideoPreprocessor(VideoSampling):
    def plan(self, header: VideoHeader, where: str) -> VideoPlan:
        """Which frames to decode and the grid they make, from the header alone."""
        patch = self.frames.temporal_patch_size
        total = header.num_frames
        most = math.floor(min(self.max_frames, total) / patch) * patch
        count = min(max(total / header.fps * self.fps, self.min_frames), most, total)
        count = math.floor(count / patch) * patch
        if count <= 0:
            raise invalid_argument(f"{where}.media is a video of {total} frames; the fewest read is {patch}")
        # As transformers picks them: a float32 range, truncated (its length may differ from count).
        indices = tuple(torch.arange(0, total, total / count).int().tolist())
        sampled_fps = len(indices) / total * header.fps
        height, width = self.frames.resized_size(header.height, header.width)
        size = self.frames.patch_size
        grid = (-(-len(indices) // patch), height // size, width // size)
        return VideoPlan(indices, grid, patch / sampled_fps)

    def patches(self, frames: list[np.ndarray]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Prepared frames (each [3, H, W], QwenPreprocessor.pixels) -> patches [t * gh * gw, 3 * T * P * P]
        and the grid (t, gh, gw)."""
        frames = list(frames)
        frames += [frames[-1]] * (-len(frames) % self.frames.temporal_patch_size)
        return self.frames.patchify(np.stack(frames))

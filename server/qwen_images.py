"""A decoded image -> the flattened patches and grid a Qwen2.5-VL tower reads, as transformers'
Qwen2VLImageProcessor prepares them.

The image is resized (Pillow, bicubic unless the config says otherwise) to the nearest sides that
are whole multiples of patch_size * merge_size with a pixel count inside [min_pixels, max_pixels]
("smart resize"), rescaled, normalised, then cut into patch_size squares, each repeated over
temporal_patch_size frames, laid out in merge_size x merge_size blocks (the merger's groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from tpserve.server.images import CLIP_MEAN, CLIP_STD
from tpserve.server.processor_config import image_processor_settings
from tpserve.server.validation import RequestRefused

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # transformers' defaults
MAX_ASPECT = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) divisible by `factor`, the pixel count within bounds, the aspect kept as
    nearly as may be; transformers' rule, rounding included."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise RequestRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"an image of {width}x{height} is more than {MAX_ASPECT} times as long as it is wide",
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenPreprocessor:
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resample: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> QwenPreprocessor:
        raw, _ = image_processor_settings(model_dir)  # either file layout (server/processor_config.py)
        size = raw.get("size") or {}
        normalize = raw.get("do_normalize", True)
        return cls(
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS),
            patch_size=int(raw.get("patch_size", 14)),
            temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            merge_size=int(raw.get("merge_size", 2)),
            resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
            mean=tuple(raw.get("image_mean", CLIP_MEAN)) if normalize else None,
            std=tuple(raw.get("image_std", CLIP_STD)) if normalize else None,
        )

    def patches(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """float32 patches [grid_h * grid_w, 3 * T * P * P] and the grid (1, grid_h, grid_w)."""
        image = image.convert("RGB")
        factor = self.patch_size * self.merge_size
        height, width = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image, dtype=np.float32)  # [H, W, 3]
        if self.rescale_factor is not None:
            array = array * np.float32(self.rescale_factor)
        if self.mean is not None:
            array = (array - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        array = array.transpose(2, 0, 1)  # [3, H, W]
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        blocks = array.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        return np.ascontiguousarray(frames.reshape(gh * gw, 3 * t * p * p), dtype=np.float32), (1, gh, gw)

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

from tpserve.server.images import rescaled, value_settings
from tpserve.server.processor_config import image_processor_settings
from tpserve.server.validation import RequestRefused

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # transformers' defaults
MAX_ASPECT = 200


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1
) -> tuple[int, int]:
    """(height, width) divisible by `factor`, the pixel count within bounds, the aspect kept as
    nearly as may be; transformers' rule, rounding included. GLM-4.1V's bounds count the `frames`
    of a temporal patch (an image's too), Qwen-VL's one frame."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise RequestRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"an image of {width}x{height} is more than {MAX_ASPECT} times as long as it is wide",
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
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
        raw, _ = image_processor_settings(
            model_dir
        )  # either file layout (tpserve/server/processor_config.py)
        return cls.from_settings(raw)

    @classmethod
    def from_settings(cls, raw: dict, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
        """From a processor's fields; min_pixels and max_pixels where the fields name neither."""
        size = raw.get("size") or {}
        return cls(
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or max_pixels),
            patch_size=int(raw.get("patch_size", 14)),
            temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            merge_size=int(raw.get("merge_size", 2)),
            **value_settings(raw),
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the smart resize: whole merge blocks of patches."""
        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def pixels(self, image: Image.Image) -> np.ndarray:
        """float32 [3, H, W]: the image resized to its smart size, rescaled and normalised."""
        return self.pixels_at(image, *self.resized_size(image.height, image.width))

    def pixels_at(self, image: Image.Image, height: int, width: int) -> np.ndarray:
        """float32 [3, height, width]: the image resized to that size, rescaled and normalised."""
        image = image.convert("RGB")
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image, dtype=np.float32)  # [H, W, 3]
        return rescaled(array, self.rescale_factor, self.mean, self.std).transpose(2, 0, 1)

    def patches(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """float32 patches [grid_h * grid_w, 3 * T * P * P] and the grid (1, grid_h, grid_w): the one
        image repeated over the temporal patch's frames."""
        array = self.pixels(image)
        return self.patchify(np.broadcast_to(array[None], (self.temporal_patch_size, *array.shape)))

    def patchify(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """frames [F, 3, H, W] (F a multiple of T) -> patches [t * gh * gw, 3 * T * P * P] laid out in
        merge blocks, each patch its T frames' pixels, and the grid (t, gh, gw)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        num_frames, channels, height, width = frames.shape
        gt, gh, gw = num_frames // t, height // p, width // p
        blocks = frames.reshape(gt, t, channels, gh // m, m, p, gw // m, m, p)
        blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, T, P, P]
        flat = blocks.reshape(gt * gh * gw, channels * t * p * p)
        return np.ascontiguousarray(flat, dtype=np.float32), (gt, gh, gw)

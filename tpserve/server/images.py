"""Image bytes -> the pixel array a vision tower reads, as the checkpoint's preprocessor config says.

Decoding is Pillow's, limited to JPEG, PNG and WebP; the size is checked from the header before any
pixel is decoded, so a small file that claims a huge image costs nothing. Then, as transformers'
CLIP/LLaVA image processors do: convert to RGB, pad to a square (LLaVA's do_pad), resize the shortest
edge, center crop, rescale and normalise. Every failure is a RequestRefused naming the part.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from tpserve.ranks.errors import ModelFileError
from tpserve.server.processor_config import image_processor_settings
from tpserve.server.validation import RequestRefused, invalid_argument

FORMATS = ("JPEG", "PNG", "WEBP")
MIME_TYPES = ("image/jpeg", "image/png", "image/webp")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def size_setting(value, what: str, path: Path) -> tuple[int, int]:
    """(height, width) from a preprocessor config's size: an int, {height, width} or {shortest_edge}."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    if isinstance(value, dict) and "shortest_edge" in value:
        return int(value["shortest_edge"]), int(value["shortest_edge"])
    raise ModelFileError(path, f"{what} {value!r} is not an int, {{height, width}} or {{shortest_edge}}")


def value_settings(raw: dict) -> dict:
    """What CLIP's and Qwen2-VL's processors read alike: the resampling filter, the rescale factor
    and the normalization's mean and std (None where the file turns them off)."""
    normalize = raw.get("do_normalize", True)
    return {
        "resample": int(raw.get("resample", Image.Resampling.BICUBIC)),
        "rescale_factor": float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
        "mean": tuple(raw.get("image_mean", CLIP_MEAN)) if normalize else None,
        "std": tuple(raw.get("image_std", CLIP_STD)) if normalize else None,
    }


def rescaled(array: np.ndarray, rescale_factor: float | None, mean, std) -> np.ndarray:
    """float32 pixels [H, W, 3] times rescale_factor, then less mean and over std, per channel; a
    None skips its step."""
    if rescale_factor is not None:
        array = array * np.float32(rescale_factor)
    if mean is not None:
        array = (array - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return array


@dataclass(frozen=True)
class Preprocessor:
    shortest_edge: int | None  # resize so the short side is this (aspect kept); None: to `resize_to`
    resize_to: tuple[int, int] | None  # (height, width)
    crop: tuple[int, int] | None  # (height, width) of the center crop
    pad_to_square: bool
    resample: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Preprocessor:
        raw, path = image_processor_settings(
            model_dir
        )  # either file layout (tpserve/server/processor_config.py)
        size = raw.get("size", {"shortest_edge": 224})
        # An int is a shortest edge too: CLIP's processor reads sizes with default_to_square=False.
        shortest = (
            size.get("shortest_edge") if isinstance(size, dict) else size if isinstance(size, int) else None
        )
        if not raw.get("do_resize", True):
            shortest = None
        return cls(
            shortest_edge=int(shortest) if shortest is not None else None,
            resize_to=None
            if shortest is not None or not raw.get("do_resize", True)
            else size_setting(size, "size", path),
            crop=size_setting(raw.get("crop_size", 224), "crop_size", path)
            if raw.get("do_center_crop", True)
            else None,
            pad_to_square=bool(raw.get("do_pad", False)),
            **value_settings(raw),
        )

    def pixels(self, image: Image.Image) -> np.ndarray:
        """A decoded image -> float32 [3, height, width]."""
        image = image.convert("RGB")
        if self.pad_to_square and image.width != image.height:
            side = max(image.size)
            fill = tuple(int(x * 255) for x in (self.mean or CLIP_MEAN))
            square = Image.new("RGB", (side, side), fill)
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        if self.shortest_edge is not None:
            short, long = sorted(image.size)
            new_long = int(self.shortest_edge * long / short)
            width, height = (
                (self.shortest_edge, new_long)
                if image.width <= image.height
                else (new_long, self.shortest_edge)
            )
            image = image.resize((width, height), resample=self.resample)
        elif self.resize_to is not None:
            image = image.resize((self.resize_to[1], self.resize_to[0]), resample=self.resample)
        array = np.asarray(image, dtype=np.float32)  # [H, W, 3]
        if self.crop is not None:
            height, width = self.crop
            top, left = (array.shape[0] - height) // 2, (array.shape[1] - width) // 2
            if top < 0 or left < 0:  # smaller than the crop: pad with zeros around, as transformers does
                padded = np.zeros((max(height, array.shape[0]), max(width, array.shape[1]), 3), np.float32)
                pt, pl = (padded.shape[0] - array.shape[0]) // 2, (padded.shape[1] - array.shape[1]) // 2
                padded[pt : pt + array.shape[0], pl : pl + array.shape[1]] = array
                array, top, left = padded, (padded.shape[0] - height) // 2, (padded.shape[1] - width) // 2
            array = array[top : top + height, left : left + width]
        array = rescaled(array, self.rescale_factor, self.mean, self.std)
        return np.ascontiguousarray(array.transpose(2, 0, 1), dtype=np.float32)


def header_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) of an image, from its header only (no pixel is decoded)."""
    unreadable = invalid_argument(f"{where}.media.data is not a readable JPEG, PNG or WebP image")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
    except Exception as error:  # an untrusted file: every way Pillow can fail is one refusal
        raise unreadable from error
    if width <= 0 or height <= 0:
        raise unreadable
    return width, height


def decode_image(data: bytes, where: str, max_pixels: int) -> Image.Image:
    """The bytes as a decoded image; refuses what is not a JPEG, PNG or WebP, or has too many pixels."""
    unreadable = invalid_argument(f"{where}.media.data is not a readable JPEG, PNG or WebP image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise invalid_argument(
                    f"{where}.media is a {width}x{height} image; the most per image is {max_pixels} pixels"
                )
            image.load()
    except RequestRefused:
        raise
    except Exception as error:  # an untrusted file: every way Pillow can fail on it is the same refusal
        raise unreadable from error
    if width <= 0 or height <= 0:
        raise unreadable
    return image

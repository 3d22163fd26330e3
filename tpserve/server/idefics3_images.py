"""A decoded image -> the tiles an Idefics3 or SmolVLM tower reads, as transformers' Idefics3 image
processor (its PIL backend) prepares them.

The image is resized (Pillow, Lanczos unless the config says otherwise) so its longest edge is
size.longest_edge, then up to whole multiples of the tile side (max_image_size.longest_edge) and cut
into rows x columns tiles, row by row, with the whole image resized to one tile after them (the global
image); an image of one tile is that tile alone (rows = columns = 0). Each resize rounds to 8-bit
pixels, as transformers' does. Then every tile is rescaled and normalised. The tile layout follows
from the image's size alone, so a prompt's expansion needs only its header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from tpserve.server.images import rescaled, value_settings
from tpserve.server.processor_config import image_processor_settings
from tpserve.server.validation import invalid_argument

MAX_IMAGE_SIZE = 4096  # transformers' bound on the longest edge after the first resize
DEFAULT_LONGEST_EDGE, DEFAULT_TILE = 4 * 364, 364  # Idefics3ImageProcessor's defaults


@dataclass(frozen=True)
class TileLayout:
    """An image's sizes through the processor: (height, width) after the longest-edge resize (None:
    none), after the resize to whole tiles, and its rows x columns of tiles (0 x 0: one tile, no
    global image)."""

    resized: tuple[int, int] | None
    tiled: tuple[int, int]
    rows: int
    cols: int

    @property
    def num_tiles(self) -> int:
        """Tiles the tower reads: each split tile and the global image, or the one tile."""
        return self.rows * self.cols + 1 if self.rows else 1


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' rescale-to-max-len (the short side made even) then scale-below-upper-bound."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def whole_tiles_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: each side up to a multiple of the tile, the long one
    first and the short one from the aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True)
class Idefics3Preprocessor:
    longest_edge: int | None  # size.longest_edge; None where do_resize is off
    tile_size: int  # max_image_size.longest_edge
    split: bool  # do_image_splitting
    resample: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Idefics3Preprocessor:
        raw, _ = image_processor_settings(
            model_dir
        )  # either file layout (tpserve/server/processor_config.py)
        return cls.from_settings(raw)

    @classmethod
    def from_settings(cls, raw: dict) -> Idefics3Preprocessor:
        size = raw.get("size") or {"longest_edge": DEFAULT_LONGEST_EDGE}
        values = value_settings(raw)
        values["resample"] = int(raw.get("resample", Image.Resampling.LANCZOS))
        return cls(
            longest_edge=int(size["longest_edge"]) if raw.get("do_resize", True) else None,
            tile_size=int((raw.get("max_image_size") or {}).get("longest_edge", DEFAULT_TILE)),
            split=bool(raw.get("do_image_splitting", True)),
            **values,
        )

    def layout(self, height: int, width: int, where: str = "image") -> TileLayout:
        """The sizes and tiles of an image of height x width (its header's)."""
        resized = longest_edge_size(height, width, self.longest_edge) if self.longest_edge else None
        height, width = resized or (height, width)
        if not self.split:
            return TileLayout(resized, (self.tile_size, self.tile_size), 0, 0)
        tiled = whole_tiles_size(height, width, self.tile_size)
        if min(tiled) <= 0:  # transformers' resize would fail on it too
            raise invalid_argument(f"{where}.media: a {width}x{height} image is too long for its width")
        if max(tiled) <= self.tile_size:
            return TileLayout(resized, tiled, 0, 0)
        return TileLayout(resized, tiled, tiled[0] // self.tile_size, tiled[1] // self.tile_size)

    def _resize(self, image: Image.Image, size: tuple[int, int]) -> Image.Image:
        return image.resize((size[1], size[0]), resample=self.resample)  # the same size: a copy

    def tiles(self, image: Image.Image, where: str = "image") -> tuple[np.ndarray, TileLayout]:
        """float32 tiles [num_tiles, 3, tile, tile] (row by row, then the global image) and the layout."""
        image = image.convert("RGB")
        layout = self.layout(image.height, image.width, where)
        if layout.resized is not None:
            image = self._resize(image, layout.resized)
        image = self._resize(image, layout.tiled)
        side = self.tile_size
        arrays = []
        if layout.rows:
            whole = np.asarray(image)
            arrays = [
                whole[r * side : (r + 1) * side, c * side : (c + 1) * side]
                for r in range(layout.rows)
                for c in range(layout.cols)
            ]
            image = self._resize(image, (side, side))
        arrays.append(np.asarray(image))
        tiles = np.stack(arrays).astype(np.float32)  # [N, tile, tile, 3]
        tiles = rescaled(tiles, self.rescale_factor, self.mean, self.std)
        return np.ascontiguousarray(tiles.transpose(0, 3, 1, 2), dtype=np.float32), layout

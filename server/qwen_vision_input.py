"""Rank 0's image inputs for a Qwen2.5-VL model: as server/vision_input.py's for LLaVA, except that an
image's token count follows its size (smart resize to the patch grid, then the 2x2 merge).

The chat template writes one image pad token per image; each becomes rows * columns positions of
the merged grid, which the image's header alone says (no pixel is decoded before the request is
otherwise accepted). Each image carries its merged grid, from which the leader works out the
chunks' multimodal rotary positions (ranks/mrope.py). The prompt-cache key is the bytes' hash.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.qwen_vision import QwenVisionTower, load_qwen_vision_tower
from tpserve.server.images import FORMATS, decode_image
from tpserve.server.qwen_images import QwenPreprocessor, smart_resize
from tpserve.server.requests import PromptImage
from tpserve.server.validation import invalid_argument
from tpserve.server.vision_input import image_key


class QwenVisionInput:
    def __init__(self, tower: QwenVisionTower, preprocessor: QwenPreprocessor, image_token: str):
        self.tower = tower
        self.preprocessor = preprocessor
        self.image_token_id = tower.config.image_token_id
        self.image_token = image_token  # its text, for the refusal when the counts disagree
        self._lock = threading.Lock()  # one image through the tower at a time: bounded memory

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, config: ModelConfig, image_token: str, dtype, device="cpu"
    ):
        tower = load_qwen_vision_tower(model_dir, config.vision, dtype, device)
        return cls(tower, QwenPreprocessor.from_model_dir(model_dir), image_token)

    def merged_grid(self, data: bytes, where: str) -> tuple[int, int]:
        """(rows, columns) of an image's merged grid, from its header (the size) only."""
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
        except Exception as error:  # an untrusted file: every way Pillow can fail is one refusal
            raise invalid_argument(f"{where}.media.data is not a readable JPEG, PNG or WebP image") from error
        if width <= 0 or height <= 0:
            raise invalid_argument(f"{where}.media.data is not a readable JPEG, PNG or WebP image")
        pre = self.preprocessor
        factor = pre.patch_size * pre.merge_size
        resized = smart_resize(height, width, factor, pre.min_pixels, pre.max_pixels)
        return resized[0] // factor, resized[1] // factor

    def expand(
        self, ids: Sequence[int], num_images: int, media: Sequence = (), wheres: Sequence[str] = ()
    ) -> tuple[list[int], list[int]]:
        """Template token ids with one image token per image -> the prompt with each widened to its
        merged grid's rows * columns, and the images' offsets in it."""
        found = [index for index, token in enumerate(ids) if token == self.image_token_id]
        if len(found) != num_images or len(media) != num_images:
            raise invalid_argument(
                f"the prompt holds {len(found)} image tokens for {num_images} image parts "
                f"(the text may not contain {self.image_token!r})"
            )
        out, offsets, at = [], [], 0
        wheres = list(wheres) or [f"image {number}" for number in range(num_images)]
        for index, part, where in zip(found, media, wheres):
            rows, cols = self.merged_grid(part.data, where)
            out += ids[at:index]
            offsets.append(len(out))
            out += [self.image_token_id] * (rows * cols)
            at = index + 1
        return out + list(ids[at:]), offsets

    def read(self, media: Sequence, offsets: Sequence[int], wheres: Sequence[str], max_pixels: int):
        """The prompt's images (media parts in prompt order, at `offsets`) with their features."""
        merge = self.tower.config.spatial_merge_size
        images = []
        for part, offset, where in zip(media, offsets, wheres):
            patches, grid = self.preprocessor.patches(decode_image(part.data, where, max_pixels))
            with self._lock:
                features = self.tower.features(patches, grid)
            merged = (grid[1] // merge, grid[2] // merge)
            key = image_key(part.data)
            images.append(PromptImage(offset, features.shape[0], key, features, grid=merged))
        return tuple(images)

"""Rank 0's image inputs for a vision-language model: decoded, prepared and read before admission.

A request's image parts are decoded and preprocessed (tpserve/server/images.py), then read by the vision
tower and projector (tpserve/ranks/vision.py, on rank 0 only) into features, one image at a time. The chat
template writes one image token per image; each becomes `tokens_per_image` positions, where the
features go. Each image's prompt-cache key comes from a hash of its bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.vision import VisionTower, load_vision_tower
from tpserve.server.images import Preprocessor, decode_image
from tpserve.server.media_checks import is_video
from tpserve.server.requests import PromptImage
from tpserve.server.validation import Limits, invalid_argument


def image_key(data: bytes) -> int:
    """A negative int64 from the bytes' SHA-256: never a token id, and the same only for the same image."""
    return -1 - (int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 2)


def media_tokens(
    ids: Sequence[int], tokens: set[int], num_images: int, image_token: str, num_parts: int | None = None
) -> list[int]:
    """Where the template wrote a media token (one of `tokens`) in `ids`; refuses when the count is
    not the request's num_images media parts (the text itself held the token, or the template wrote
    none), or not num_parts, where given."""
    found = [index for index, token in enumerate(ids) if token in tokens]
    if len(found) != num_images or num_parts not in (None, num_images):
        raise invalid_argument(
            f"the prompt holds {len(found)} image tokens for {num_images} image parts "
            f"(the text may not contain {image_token!r})"
        )
    return found


def apart(data: bytes, features, offsets: Sequence[int], size: int, grid=None) -> list[PromptImage]:
    """A part whose image runs lie apart in the prompt (a Qwen3-VL video's temporal patches, an
    Idefics3 image's tiles): one PromptImage of `size` positions per offset, run i the features'
    rows i * size onwards, keyed by the bytes' hash once and its index."""
    digest = hashlib.sha256(data).digest()
    return [
        PromptImage(
            offset, size, image_key(digest + b"#%d" % run), features[run * size : (run + 1) * size], grid
        )
        for run, offset in enumerate(offsets)
    ]


@dataclass(frozen=True)
class PlacedPart:
    """Where a media part's positions start in the prompt, and what expand already read of it that
    read reuses (a video's packets: tpserve/server/videos.py; None for an image)."""

    offset: int
    video: object = None
    # Where each run of a part's image tokens starts, where they lie apart: a Qwen3-VL video's temporal
    # patches (each after its time), an Idefics3 image's tiles (tpserve/server/idefics3_input.py)
    frame_offsets: tuple[int, ...] = ()

    def shifted(self, by: int) -> PlacedPart:
        return PlacedPart(self.offset + by, self.video, tuple(offset + by for offset in self.frame_offsets))


class VisionInput:
    # whether an image's positions go in one pass (PromptImage.whole): Gemma 3's, whose rows see
    # each other (tpserve/server/gemma3_input.py)
    whole_images = False

    def __init__(self, tower: VisionTower, preprocessor: Preprocessor, image_token: str):
        self.tower = tower
        self.preprocessor = preprocessor
        self.image_token_id = tower.config.image_token_id
        self.tokens_per_image = tower.config.tokens_per_image
        self.image_token = image_token  # its text, for the refusal when the counts disagree
        self._lock = threading.Lock()  # one image through the tower at a time: bounded memory

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, config: ModelConfig, image_token: str, dtype, device="cpu"
    ):
        tower = load_vision_tower(model_dir, config.vision, dtype, device)
        return cls(tower, Preprocessor.from_model_dir(model_dir), image_token)

    def expand(
        self,
        ids: Sequence[int],
        num_images: int,
        media: Sequence = (),
        wheres: Sequence[str] = (),
        limits=None,
    ) -> tuple[list[int], list[PlacedPart]]:
        """Template token ids with one image token per image -> the prompt with each widened to
        tokens_per_image, and the images' places in it. Refuses when the counts disagree (the text
        itself held the image token, or the template wrote none). `media` and `wheres` (the parts
        and where they sit) say which part is a video, refused here: LLaVA reads images only; every
        image takes the same count. `limits` is not read (the same call as
        tpserve/server/qwen_vision_input.py's)."""
        for part, where in zip(media, wheres):
            if is_video(part):
                raise invalid_argument(
                    f"{where}.media: this model reads no video inputs (send its frames as images)"
                )
        found = media_tokens(ids, {self.image_token_id}, num_images, self.image_token)
        out, placed, at = [], [], 0
        for index in found:
            out += ids[at:index]
            placed.append(PlacedPart(len(out)))
            out += [self.image_token_id] * self.tokens_per_image
            at = index + 1
        return out + list(ids[at:]), placed

    def read(self, media: Sequence, placed: Sequence[PlacedPart], wheres: Sequence[str], limits: Limits):
        """The prompt's images (media parts in prompt order, at `placed`, as expand returned) with
        their features."""
        pixels = [
            self.preprocessor.pixels(decode_image(part.data, where, limits.max_image_pixels))
            for part, where in zip(media, wheres)
        ]
        images = []
        for part, place, array in zip(media, placed, pixels):
            with self._lock:
                features = self.tower.features(array)
            key = image_key(part.data)
            images.append(
                PromptImage(place.offset, self.tokens_per_image, key, features, whole=self.whole_images)
            )
        return tuple(images)

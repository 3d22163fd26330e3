"""The vision side of a Qwen3-VL checkpoint: its ViT's shape, the learned position table, the 2x2 merger
and the layers whose deepstack mergers feed the text model, read from config.json's vision_config
(missing keys take transformers' Qwen3VLVisionConfig defaults); the media tokens, and the text model's
mrope sections, which Qwen3-VL interleaves (t, h, w, t, h, w, ... over the rotary's frequencies)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.qwen_vision_config import PatchGrid, grid_fields, vision_rope_theta

QWEN3_VL_ARCHITECTURES = ("Qwen3VLForConditionalGeneration",)
QWEN3_VISION_DEFAULTS = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class Qwen3VisionConfig(PatchGrid):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int  # a square table, side * side
    deepstack_visual_indexes: tuple[int, ...]  # blocks after which a deepstack merger reads
    hidden_act: str
    rope_theta: float
    out_hidden_size: int
    image_token_id: int
    video_token_id: int | None
    mrope_section: tuple[int, ...]  # the text rotary's frequencies per axis (t, h, w)
    vision_start_token_id: int | None = None  # around each video frame's pads (after its time in text)
    vision_end_token_id: int | None = None
    mrope_interleaved: bool = True

    @property
    def num_deepstack(self) -> int:
        """The text layers (the first ones) a deepstack merger's features are added after."""
        return len(self.deepstack_visual_indexes)

    @property
    def position_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


def parse_qwen3_vision_config(raw: dict, text: dict, head_dim: int, path: str | Path) -> Qwen3VisionConfig:
    vision = {**QWEN3_VISION_DEFAULTS, **(raw.get("vision_config") or {})}
    if vision["hidden_act"] not in ACTIVATIONS:
        raise ModelFileError(
            path, f"vision_config.hidden_act {vision['hidden_act']!r} is not one of {', '.join(ACTIVATIONS)}"
        )
    if vision["hidden_size"] % vision["num_heads"] or (vision["hidden_size"] // vision["num_heads"]) % 4:
        raise ModelFileError(path, "vision_config.hidden_size is not num_heads heads of a multiple of 4")
    side = math.isqrt(int(vision["num_position_embeddings"]))
    if side * side != vision["num_position_embeddings"]:
        raise ModelFileError(path, "vision_config.num_position_embeddings is not a square")
    indexes = tuple(int(i) for i in vision["deepstack_visual_indexes"])
    if any(not 0 <= i < vision["depth"] for i in indexes):
        raise ModelFileError(path, f"vision_config.deepstack_visual_indexes {list(indexes)} past its depth")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != head_dim // 2 or 3 * max(section[1:]) > head_dim // 2:
        raise ModelFileError(
            path,
            f"mrope_section {list(section)} must be three numbers summing to head_dim / 2 ({head_dim // 2}), "
            "each of h and w at most a third of it",
        )
    if not rope.get("mrope_interleaved", True):
        raise ModelFileError(path, "Qwen3-VL's mrope_interleaved false (sections in runs) is not implemented")
    image_token_id = raw.get("image_token_id", text.get("image_token_id"))
    if not isinstance(image_token_id, int):
        raise ModelFileError(path, "missing 'image_token_id'")
    return Qwen3VisionConfig(
        **grid_fields(vision),
        num_position_embeddings=int(vision["num_position_embeddings"]),
        deepstack_visual_indexes=indexes,
        hidden_act=vision["hidden_act"],
        rope_theta=vision_rope_theta(vision),
        out_hidden_size=int(vision["out_hidden_size"]),
        image_token_id=image_token_id,
        video_token_id=raw.get("video_token_id", text.get("video_token_id")),
        mrope_section=section,
        vision_start_token_id=raw.get("vision_start_token_id"),
        vision_end_token_id=raw.get("vision_end_token_id"),
    )

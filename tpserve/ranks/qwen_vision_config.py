"""The vision side of a Qwen2.5-VL checkpoint: the windowed ViT's shape, the 2x2 merger and the
media tokens, read from config.json's vision_config and top-level keys (missing keys take
transformers' Qwen2_5_VLVisionConfig defaults), and the text model's mrope sections."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

QWEN_VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
QWEN_VISION_DEFAULTS = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 4,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
ACTIVATIONS = ("silu", "gelu")
# The tower's shape, in every Qwen-VL-style vision_config (Qwen2.5-VL's, Qwen3-VL's, GLM-4.1V's)
GRID_KEYS = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
)


def grid_fields(vision: dict) -> dict[str, int]:
    """GRID_KEYS' values as ints (in_channels also under transformers 4's name, in_chans)."""
    renamed = {"in_channels": "in_chans"} if "in_chans" in vision else {}
    return {key: int(vision[renamed.get(key, key)]) for key in GRID_KEYS}


def vision_rope_theta(vision: dict) -> float:
    return float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))


class PatchGrid:
    """What a Qwen-VL-style tower's config derives from its shape (GRID_KEYS)."""

    hidden_size: int
    num_heads: int
    in_channels: int
    temporal_patch_size: int
    patch_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values in one flattened patch, as the processor writes them: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class QwenVisionConfig(PatchGrid):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    hidden_act: str
    tokens_per_second: float
    rope_theta: float
    out_hidden_size: int
    image_token_id: int
    video_token_id: int | None
    mrope_section: tuple[int, ...]  # the text rotary's frequencies per axis (t, h, w)
    mrope_interleaved: bool = False  # Qwen2.5-VL's sections are runs: all t, then h, then w
    num_deepstack: int = 0  # no features are added past the embedding (Qwen3-VL's deepstack)

    def tokens_for(self, grid: tuple[int, int, int]) -> int:
        """Text positions an image (or video) of patch grid (t, h, w) takes after the 2x2 merge."""
        t, h, w = grid
        return t * h * w // self.spatial_merge_size**2


def parse_qwen_vision_config(raw: dict, text: dict, head_dim: int, path: str | Path) -> QwenVisionConfig:
    vision = {**QWEN_VISION_DEFAULTS, **(raw.get("vision_config") or {})}
    if vision["hidden_act"] not in ACTIVATIONS:
        raise ModelFileError(
            path, f"vision_config.hidden_act {vision['hidden_act']!r} is not one of {', '.join(ACTIVATIONS)}"
        )
    if vision["hidden_size"] % vision["num_heads"]:
        raise ModelFileError(path, "vision_config.hidden_size does not divide into num_heads")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {}
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelFileError(
            path,
            f"mrope_section {list(section)} must be three numbers summing to head_dim / 2 ({head_dim // 2})",
        )
    image_token_id = raw.get("image_token_id", text.get("image_token_id"))
    if not isinstance(image_token_id, int):
        raise ModelFileError(path, "missing 'image_token_id'")
    return QwenVisionConfig(
        **grid_fields(vision),
        window_size=int(vision["window_size"]),
        fullatt_block_indexes=tuple(int(i) for i in vision["fullatt_block_indexes"]),
        hidden_act=vision["hidden_act"],
        tokens_per_second=float(vision["tokens_per_second"]),
        rope_theta=vision_rope_theta(vision),
        out_hidden_size=int(vision["out_hidden_size"]),
        image_token_id=image_token_id,
        video_token_id=raw.get("video_token_id", text.get("video_token_id")),
        mrope_section=section,
    )

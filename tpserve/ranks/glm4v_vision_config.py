"""The vision side of a GLM-4.1V checkpoint: its ViT's shape (RMSNorms, a learned position table
resampled to each grid, the downsample conv and the GLU merger), read from config.json's vision_config
(missing keys take transformers' Glm4vVisionConfig defaults); the media tokens, and the text model's mrope
sections (runs of t, h and w over the rotating half of each head)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.qwen_vision_config import PatchGrid, grid_fields, vision_rope_theta

# GLM-4.1V, and GLM-4.5V (its text model GLM-4.5's mixture of experts; the same tower)
GLM4V_ARCHITECTURES = ("Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration")
GLM4V_VISION_DEFAULTS = {
    "depth": 24,
    "hidden_size": 1536,
    "hidden_act": "silu",
    "attention_bias": False,
    "num_heads": 12,
    "in_channels": 3,
    "image_size": 336,
    "patch_size": 14,
    "rms_norm_eps": 1e-5,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 4096,
    "intermediate_size": 13696,
}
GLM4V_TOKENS = {  # transformers' Glm4vConfig defaults (Glm4vMoeConfig's image and video tokens: +20)
    "image_token_id": 151343,
    "video_token_id": 151344,
    "image_start_token_id": 151339,
    "image_end_token_id": 151340,
}
GLM4V_MOE_TOKENS = GLM4V_TOKENS | {"image_token_id": 151363, "video_token_id": 151364}


@dataclass(frozen=True)
class Glm4vVisionConfig(PatchGrid):
    depth: int
    hidden_size: int
    intermediate_size: int  # the merger's GLU width (each block's MLP is out_hidden_size wide)
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    position_side: int  # the learned position table is position_side x position_side
    attention_bias: bool
    rms_norm_eps: float
    rope_theta: float
    out_hidden_size: int
    image_token_id: int
    video_token_id: int | None
    image_start_token_id: int | None
    image_end_token_id: int | None
    mrope_section: tuple[int, ...]  # the text rotary's frequencies per axis (t, h, w), in runs
    mrope_interleaved: bool = False
    num_deepstack: int = 0


def parse_glm4v_vision_config(
    raw: dict, text: dict, rotary_dim: int, path: str | Path, moe: bool = False
) -> Glm4vVisionConfig:
    vision = {**GLM4V_VISION_DEFAULTS, **(raw.get("vision_config") or {})}
    if vision["hidden_act"] != "silu":
        raise ModelFileError(path, f"vision_config.hidden_act {vision['hidden_act']!r} is not silu")
    if vision["hidden_size"] % vision["num_heads"] or (vision["hidden_size"] // vision["num_heads"]) % 4:
        raise ModelFileError(path, "vision_config.hidden_size is not num_heads heads of a multiple of 4")
    if vision["image_size"] % vision["patch_size"]:
        raise ModelFileError(path, "vision_config.image_size is not a whole number of patches")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ModelFileError(
            path,
            f"mrope_section {list(section)} must be three numbers summing to the rotary's {rotary_dim // 2} "
            "frequencies (half the rotating dims)",
        )
    defaults = GLM4V_MOE_TOKENS if moe else GLM4V_TOKENS
    tokens = {key: raw.get(key, default) for key, default in defaults.items()}
    return Glm4vVisionConfig(
        **grid_fields(vision),
        position_side=int(vision["image_size"]) // int(vision["patch_size"]),
        attention_bias=bool(vision["attention_bias"]),
        rms_norm_eps=float(vision["rms_norm_eps"]),
        rope_theta=vision_rope_theta(vision),
        out_hidden_size=int(vision["out_hidden_size"]),
        mrope_section=section,
        **tokens,
    )

"""The vision side of an Idefics3 or SmolVLM checkpoint: the SigLIP tower's shape, the pixel-shuffle
connector's scale factor and the image token, read from config.json's vision_config and top-level keys
(missing keys take transformers' Idefics3VisionConfig and Idefics3Config defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

IDEFICS3_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
SIGLIP_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
TEXT_DEFAULTS = {"rms_norm_eps": 1e-5}  # Idefics3Config's text model: a Llama with this eps


@dataclass(frozen=True)
class Idefics3VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # a tile's side: the position table covers (image_size / patch_size)^2 patches
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    scale_factor: int  # the connector's pixel shuffle: scale^2 neighbouring patches become one token
    text_hidden_size: int
    image_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def image_seq_len(self) -> int:
        """Image tokens per tile (and for the global image), as Idefics3Model counts them."""
        return self.patches_per_side**2 // self.scale_factor**2


def siglip_fields(vision: dict, path: str | Path) -> dict:
    """A SigLIP tower's shape from a vision_config (its defaults filled in), checked: the fields
    Idefics3VisionConfig and Gemma3VisionConfig (tpserve/ranks/gemma3_vision_config.py) share."""
    if vision["hidden_act"] not in ACTIVATIONS:
        raise ModelFileError(
            path, f"vision_config.hidden_act {vision['hidden_act']!r} is not one of {', '.join(ACTIVATIONS)}"
        )
    for key in ("image_size", "patch_size"):
        if not isinstance(vision[key], int):
            raise ModelFileError(path, f"vision_config.{key} {vision[key]!r} is not one int (a square)")
    if vision["hidden_size"] % vision["num_attention_heads"]:
        raise ModelFileError(path, "vision_config.hidden_size does not divide into num_attention_heads")
    return {
        "hidden_size": int(vision["hidden_size"]),
        "intermediate_size": int(vision["intermediate_size"]),
        "num_layers": int(vision["num_hidden_layers"]),
        "num_heads": int(vision["num_attention_heads"]),
        "num_channels": int(vision["num_channels"]),
        "image_size": vision["image_size"],
        "patch_size": vision["patch_size"],
        "hidden_act": vision["hidden_act"],
        "layer_norm_eps": float(vision["layer_norm_eps"]),
    }


def parse_idefics3_config(raw: dict, text_hidden_size: int, path: str | Path) -> Idefics3VisionConfig:
    vision = {**SIGLIP_DEFAULTS, **(raw.get("vision_config") or {})}
    fields = siglip_fields(vision, path)
    scale = raw.get("scale_factor", 2)
    if not isinstance(scale, int) or scale < 1 or (vision["image_size"] // vision["patch_size"]) % scale:
        raise ModelFileError(
            path,
            f"scale_factor {scale!r} does not divide the tile's {vision['image_size'] // vision['patch_size']} patches a side",
        )
    image_token_id = raw.get("image_token_id", 128257)
    if not isinstance(image_token_id, int):
        raise ModelFileError(path, f"image_token_id {image_token_id!r} is not a token id")
    return Idefics3VisionConfig(
        **fields,
        scale_factor=scale,
        text_hidden_size=text_hidden_size,
        image_token_id=image_token_id,
    )

"""The vision side of a LLaVA-family checkpoint: the CLIP tower's shape, the projector and the image
token, read from config.json's vision_config and top-level keys (missing keys take transformers'
defaults, as llava-hf configs rely on)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
CLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
ACTIVATIONS = ("quick_gelu", "gelu")
SELECT_STRATEGIES = ("default", "full")  # default drops the CLS position


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    feature_layers: tuple[int, ...]  # hidden states taken (0: after pre_layrnorm), concatenated
    select_strategy: str
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_needed(self) -> int:
        """Encoder layers to run: the deepest hidden state taken (later layers feed nothing)."""
        return max(self.feature_layers)


def parse_vision_config(raw: dict, text_hidden_size: int, path: str | Path) -> VisionConfig:
    vision = {**CLIP_DEFAULTS, **(raw.get("vision_config") or {})}
    model_type = vision.get("model_type", "clip_vision_model")
    if model_type != "clip_vision_model":
        raise ModelFileError(
            path, f"vision tower {model_type!r} is not supported (supported: clip_vision_model)"
        )
    num_layers = int(vision["num_hidden_layers"])
    layers = raw.get("vision_feature_layer", -2)
    layers = list(layers) if isinstance(layers, list) else [layers]
    feature_layers = tuple(layer % (num_layers + 1) for layer in layers)  # hidden_states has L + 1 entries
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in SELECT_STRATEGIES:
        raise ModelFileError(
            path, f"vision_feature_select_strategy {strategy!r} is not one of {SELECT_STRATEGIES}"
        )
    for key, act in (
        ("vision_config.hidden_act", vision["hidden_act"]),
        ("projector_hidden_act", raw.get("projector_hidden_act", "gelu")),
    ):
        if act not in ACTIVATIONS:
            raise ModelFileError(path, f"{key} {act!r} is not one of {', '.join(ACTIVATIONS)}")
    image_token_id = raw.get("image_token_index", raw.get("image_token_id"))
    if not isinstance(image_token_id, int):
        raise ModelFileError(path, "missing 'image_token_index'")
    return VisionConfig(
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(vision["num_attention_heads"]),
        num_channels=int(vision["num_channels"]),
        image_size=int(vision["image_size"]),
        patch_size=int(vision["patch_size"]),
        hidden_act=vision["hidden_act"],
        layer_norm_eps=float(vision["layer_norm_eps"]),
        feature_layers=feature_layers,
        select_strategy=strategy,
        projector_act=raw.get("projector_hidden_act", "gelu"),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        text_hidden_size=text_hidden_size,
        image_token_id=image_token_id,
    )

"""The vision side of a Gemma 3 checkpoint (Gemma3ForConditionalGeneration): the SigLIP tower's shape
from vision_config (missing keys take transformers' SiglipVisionConfig defaults), the projector's
pooling to mm_tokens_per_image, and the image tokens; and the text model's keys under text_config,
with Gemma3TextConfig's defaults for those a checkpoint leaves out (Google's config.json names few)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.idefics3_config import siglip_fields

GEMMA3_VL_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
SIGLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
}
# Gemma3Config's image tokens: the placeholder, and the tokens Gemma3Processor writes around its run
TOKEN_DEFAULTS = {"image_token_index": 262_144, "boi_token_index": 255_999, "eoi_token_index": 256_000}


@dataclass(frozen=True)
class Gemma3VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # the image's side after the processor's resize
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    tokens_per_image: int  # mm_tokens_per_image: the pooled grid's cells
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int  # <start_of_image>: what the chat template writes for an image
    eoi_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool_size(self) -> int:
        """The projector's average pool: pool_size x pool_size patches become one image token."""
        return self.patches_per_side // math.isqrt(self.tokens_per_image)


def gemma3_text_settings(raw: dict) -> dict:
    """text_config with Gemma3TextConfig's defaults, and the top level's token ids and tying where
    text_config leaves them out."""
    text = {**GEMMA3_TEXT_DEFAULTS, **(raw.get("text_config") or {})}
    if "layer_types" not in text and "sliding_window_pattern" not in text:
        text["sliding_window_pattern"] = text.get("_sliding_window_pattern", 6)
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in (raw.get("text_config") or {}) and key in raw:
            text[key] = raw[key]
    return text


def parse_gemma3_vision_config(raw: dict, text_hidden_size: int, path: str | Path) -> Gemma3VisionConfig:
    fields = siglip_fields({**SIGLIP_VISION_DEFAULTS, **(raw.get("vision_config") or {})}, path)
    tokens = raw.get("mm_tokens_per_image", 256)
    side = fields["image_size"] // fields["patch_size"]
    if (
        not isinstance(tokens, int)
        or tokens <= 0
        or math.isqrt(tokens) ** 2 != tokens
        or side % math.isqrt(tokens)
    ):
        raise ModelFileError(
            path,
            f"mm_tokens_per_image {tokens!r} is not a square whose side divides the tower's {side} patches",
        )
    if (raw.get("vision_config") or {}).get("vision_use_head"):
        raise ModelFileError(
            path, "Gemma3: vision_config.vision_use_head (a pooling head) is not implemented"
        )
    ids = {}
    for key, default in TOKEN_DEFAULTS.items():
        value = raw.get(key, raw.get(key.replace("_index", "_id"), default))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelFileError(path, f"{key} {value!r} is not a token id")
        ids[key] = value
    return Gemma3VisionConfig(
        **fields,
        tokens_per_image=tokens,
        text_hidden_size=text_hidden_size,
        image_token_id=ids["image_token_index"],
        boi_token_id=ids["boi_token_index"],
        eoi_token_id=ids["eoi_token_index"],
    )

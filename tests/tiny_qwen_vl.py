"""A tiny random Qwen2.5-VL written by the tests with transformers' own classes: the windowed ViT
(patches of 6 pixels, windows of 2x2 merge blocks, one full-attention block of three), the 2x2
merger and a Qwen2 text model with mrope sections (2, 3, 3), saved with save_pretrained beside its
tokenizer (the vision specials), chat template and Qwen2VLImageProcessor's own save_pretrained.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import BASE, SPECIAL_TOKENS
from tiny_vlm import chat_template, save_with_tokenizer, scramble, text_settings, train_tokenizer
from tokenizers import Tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = range(
    len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(VISION_TOKENS)
)
PATCH, MERGE, TEMPORAL = 6, 2, 2
MIN_PIXELS, MAX_PIXELS = 12 * 12, 12 * 12 * 80
CHAT_TEMPLATE = chat_template(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
)


def qwen_vl_tokenizer() -> Tokenizer:
    tokenizer = train_tokenizer(VISION_TOKENS)
    assert tokenizer.token_to_id("<|image_pad|>") == IMAGE_TOKEN_ID
    return tokenizer


def write_tiny_qwen_vl(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_vl_tokenizer()
    text = text_settings(tokenizer.get_vocab_size())
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "spatial_merge_size": MERGE,
        "window_size": 2 * MERGE * PATCH,  # windows of 2x2 merge blocks
        "fullatt_block_indexes": [1],
        "out_hidden_size": BASE["hidden_size"],
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    scramble(model, seed, ("norm", "ln_q"))
    save_with_tokenizer(out, model, tokenizer, CHAT_TEMPLATE)
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    processor.save_pretrained(out)
    return out

"""A tiny random Qwen3-VL written by transformers' own classes (Qwen3VLConfig, save_pretrained, and the
image processor's own save_pretrained: Qwen3-VL's is Qwen2-VL's; its video processor imports torchvision,
which has no build for this torch here, so its video_preprocessor_config.json is written by hand):
a 2-block ViT of width 32 with one deepstack merger (after block
0) and a 4x4 learned position table, and a Qwen3 text model with interleaved mrope sections, beside the
tests' tokenizer and chat template (tests/tiny_qwen_vl.py's).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import BASE
from tiny_qwen_vl import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    qwen_vl_tokenizer,
)
from tiny_vlm import save_with_tokenizer, scramble, text_settings

PATCH, MERGE, TEMPORAL = 8, 2, 2
# Qwen3VLVideoProcessor's fields, written here (saving one needs torchvision): its pixel bounds count
# every sampled frame (4 frames of 16x16 to 4 of 64x64), its values Qwen3-VL's own (mean and std 0.5).
VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4 * 16 * 16, "longest_edge": 4 * 64 * 64},
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "merge_size": MERGE,
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
}


def write_tiny_qwen3_vl(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_vl_tokenizer()
    text = text_settings(tokenizer.get_vocab_size())
    head_dim = BASE["hidden_size"] // BASE["num_attention_heads"]
    text["head_dim"] = head_dim
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
        "mrope_interleaved": True,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "spatial_merge_size": MERGE,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
        "out_hidden_size": BASE["hidden_size"],
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    scramble(model, seed, ("norm",))
    save_with_tokenizer(out, model, tokenizer, CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(
        patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE
    ).save_pretrained(out)
    return out

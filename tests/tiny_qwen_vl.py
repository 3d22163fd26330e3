"""A tiny random Qwen2.5-VL written by the tests with transformers' own classes: the windowed ViT
(patches of 6 pixels, windows of 2x2 merge blocks, one full-attention block of three), the 2x2
merger and a Qwen2 text model with mrope sections (2, 3, 3), saved with save_pretrained beside its
tokenizer (the vision specials), chat template and Qwen2VLImageProcessor's own save_pretrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import BASE, SPECIAL_TOKENS
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = range(
    len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(VISION_TOKENS)
)
PATCH, MERGE, TEMPORAL = 6, 2, 2
MIN_PIXELS, MAX_PIXELS = 12 * 12, 12 * 12 * 80
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[*SPECIAL_TOKENS, *VISION_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "what is in this picture", "hello world"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    assert tokenizer.token_to_id("<|image_pad|>") == IMAGE_TOKEN_ID
    return tokenizer


def write_tiny_qwen_vl(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    text = {
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": BASE["hidden_size"],
        "intermediate_size": BASE["intermediate_size"],
        "num_hidden_layers": BASE["num_hidden_layers"],
        "num_attention_heads": BASE["num_attention_heads"],
        "num_key_value_heads": BASE["num_key_value_heads"],
        "rms_norm_eps": BASE["rms_norm_eps"],
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
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
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights far from transformers' tiny init, so the logits say something
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name or "ln_q" in name
            if is_norm:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * (1.0 if "embed_tokens" in name else 0.2))
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "add_bos_token": False})
    )
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    processor.save_pretrained(out)
    return out

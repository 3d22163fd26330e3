"""A tiny random Idefics3 (or SmolVLM) written by transformers' own classes (Idefics3Config or
SmolVLMConfig, save_pretrained): a 2-layer SigLIP tower of width 32 over 32-pixel tiles of 8-pixel
patches (a 4x4 grid, shuffled 2x2 into 4 image tokens per tile), the linear projection, and the tiny
Llama as its text model; beside it the tests' tokenizer with Idefics3's specials (<image>, the fake
token around it, <global-img>, <row_i_col_j>), a chat template writing one <image> per image part, and
Idefics3Processor's own save_pretrained (transformers 5: processor_config.json, the image processor's
fields under "image_processor"; the PIL image processor, as torchvision has no build here). Images are
resized so the longest edge is 96 (up to 3x3 tiles and the global image).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import SPECIAL_TOKENS
from tiny_vlm import chat_template, save_with_tokenizer, scramble, text_settings, train_tokenizer
from tokenizers import Tokenizer

FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<image>", "<global-img>"
ROW_COL_TOKENS = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
VISION_TOKENS = [FAKE_TOKEN, IMAGE_TOKEN, "<end_of_utterance>", GLOBAL_TOKEN, *ROW_COL_TOKENS]
IMAGE_TOKEN_ID = len(SPECIAL_TOKENS) + 1
TILE, PATCH, SCALE, LONGEST = 32, 8, 2, 96
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE**2
CHAT_TEMPLATE = chat_template(IMAGE_TOKEN)
ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


def idefics3_tokenizer() -> Tokenizer:
    tokenizer = train_tokenizer(VISION_TOKENS)
    assert tokenizer.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return tokenizer


def write_tiny_idefics3(
    out_dir: str | Path, seed: int = 0, architecture: str = ARCHITECTURES[0], splitting: bool = True
) -> Path:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = idefics3_tokenizer()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": TILE,
        "patch_size": PATCH,
    }
    config_class, model_class = {
        ARCHITECTURES[0]: (Idefics3Config, Idefics3ForConditionalGeneration),
        ARCHITECTURES[1]: (SmolVLMConfig, SmolVLMForConditionalGeneration),
    }[architecture]
    config = config_class(
        text_config={"model_type": "llama", **text_settings(tokenizer.get_vocab_size())},
        vision_config=vision,
        scale_factor=SCALE,
        image_token_id=IMAGE_TOKEN_ID,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    scramble(model, seed, ("norm",))
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST},
        max_image_size={"longest_edge": TILE},
        do_image_splitting=splitting,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    Idefics3Processor(image_processor, fast, image_seq_len=IMAGE_SEQ_LEN).save_pretrained(out)
    save_with_tokenizer(
        out, model, tokenizer, CHAT_TEMPLATE
    )  # after: the processor writes its own tokenizer files
    return out

"""A tiny random Gemma 3 vision-language model written by transformers' own classes (Gemma3Config,
Gemma3ForConditionalGeneration, save_pretrained): a 2-layer SigLIP tower of width 32 over 32-pixel
images of 4-pixel patches (an 8x8 grid, average-pooled 2x2 into 16 image tokens), the projector's
(1 + w) RMSNorm and projection, and a 3-layer Gemma 3 text model whose sliding window (8) is shorter
than an image's tokens; beside it the tests' tokenizer with Gemma 3's image specials, a chat template
writing `<start_of_image>` per image part, and Gemma3Processor's own save_pretrained (transformers 5:
processor_config.json; the PIL image processor, as torchvision has no build here).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import SPECIAL_TOKENS
from tiny_vlm import chat_template, save_with_tokenizer, scramble, text_settings, train_tokenizer
from tokenizers import Tokenizer

BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
BOI_TOKEN_ID = len(SPECIAL_TOKENS)
IMAGE_TOKEN_ID, EOI_TOKEN_ID = BOI_TOKEN_ID + 1, BOI_TOKEN_ID + 2
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE, WINDOW = 32, 4, 16, 8
CHAT_TEMPLATE = chat_template(BOI_TOKEN)
EXTRA_SPECIALS = {"boi_token": BOI_TOKEN, "image_token": IMAGE_TOKEN, "eoi_token": EOI_TOKEN}


def gemma3v_tokenizer() -> Tokenizer:
    tokenizer = train_tokenizer([BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN])
    assert tokenizer.token_to_id(BOI_TOKEN) == BOI_TOKEN_ID
    return tokenizer


def write_tiny_gemma3v(out_dir: str | Path, seed: int = 0, **processor_options) -> Path:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = gemma3v_tokenizer()
    text = text_settings(tokenizer.get_vocab_size()) | {
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI_TOKEN_ID,
        eoi_token_index=EOI_TOKEN_ID,
        image_token_index=IMAGE_TOKEN_ID,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    scramble(model, seed, ("norm",))
    with torch.no_grad():  # Gemma scales its embeddings by sqrt(hidden): unit noise after it, so a
        # reply is not the last token's own embedding again and again
        model.get_input_embeddings().weight.mul_(text["hidden_size"] ** -0.5)
    image_processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **processor_options
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        extra_special_tokens=EXTRA_SPECIALS,
    )
    Gemma3Processor(image_processor, fast, image_seq_length=TOKENS_PER_IMAGE).save_pretrained(out)
    save_with_tokenizer(out, model, tokenizer, CHAT_TEMPLATE)  # after: the processor writes its own
    # Gemma3Processor reads its image tokens from the tokenizer's extra specials (AutoProcessor too)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings |= {"tokenizer_class": "PreTrainedTokenizerFast", "extra_special_tokens": EXTRA_SPECIALS}
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out

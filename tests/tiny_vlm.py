"""What the tiny vision-language models share (tests/tiny_llava.py, tests/tiny_qwen_vl.py): the chat
template over typed parts, a byte-level BPE tokenizer with the models' own specials, the tiny Llama's
text settings, weights far from transformers' tiny init, and the files saved beside the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import BASE, SPECIAL_TOKENS
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def chat_template(image_text: str, video_text: str = "") -> str:
    """Content as transformers' multimodal templates take it, a list of typed parts; each image
    part writes image_text, each video part video_text (where given)."""
    video = "{% elif part['type'] == 'video' %}" + video_text if video_text else ""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'image' %}"
        + image_text
        + video
        + "{% else %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def train_tokenizer(extra_specials: list[str]) -> Tokenizer:
    """A byte-level BPE of 320 tokens on a few phrases; the specials (the tiny models', then
    extra_specials) take the first ids in order."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[*SPECIAL_TOKENS, *extra_specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "what is in this picture", "hello world"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def text_settings(vocab_size: int) -> dict:
    """The text model's sizes: the tiny Llama's (tests/tiny_models.py BASE)."""
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return {
        "vocab_size": vocab_size,
        **{key: BASE[key] for key in (*sizes, "num_key_value_heads", "rms_norm_eps")},
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def scramble(model: torch.nn.Module, seed: int, norm_markers: tuple[str, ...]) -> None:
    """Weights far from transformers' tiny init, so the logits say something: norm weights (names
    with any of norm_markers) near 1, their biases small, the embeddings unit noise, the rest 0.2."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = any(marker in name for marker in norm_markers)
            if is_norm and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * (1.0 if "embed_tokens" in name else 0.1 if is_norm else 0.2))


def save_with_tokenizer(out: Path, model, tokenizer: Tokenizer, chat_template: str) -> None:
    """The model, its tokenizer.json and a tokenizer_config.json holding the chat template."""
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": chat_template, "eos_token": "<|endoftext|>", "add_bos_token": False})
    )

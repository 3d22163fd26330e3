"""Tiny random models written by the tests: config.json, model.safetensors, tokenizer files.

One variant per supported architecture. Weights are seeded, so a variant is the same every time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

BASE = {
    "hidden_size": 96,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
VARIANTS = {
    # Uneven 2+1 KV split, tied embeddings: the shape of SmolLM2.
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True},
    "llama-mha-scaled": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 6,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_key_value_heads": 2},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_key_value_heads": 2},
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 16,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
}


def build_tokenizer(vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """Byte-level BPE over a small corpus, `special_tokens` first (ids 0, 1, ...)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", "tensor parallel serving"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def write_tiny_model(
    out_dir: str | Path, variant: str = "llama", seed: int = 0, overrides: dict | None = None
) -> Path:
    """The variant's tiny model at `out_dir`; `overrides` replace config.json fields (sizes)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(320)
    config = {**BASE, **VARIANTS[variant], **(overrides or {}), "vocab_size": tokenizer.get_vocab_size()}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "add_bos_token": False})
    )
    save_file(random_weights(config, seed), str(out / "model.safetensors"))
    return out


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_width = config["num_attention_heads"] * head_dim
    kv_width = config["num_key_value_heads"] * head_dim

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=gen) * scale).contiguous()

    def norm(size):
        return 1.0 + rand(size, scale=0.1)

    weights = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0), "model.norm.weight": norm(hidden)}
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = rand(vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights |= {
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": rand(q_width, hidden),
            p + "self_attn.k_proj.weight": rand(kv_width, hidden),
            p + "self_attn.v_proj.weight": rand(kv_width, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_width),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
        if config["model_type"] == "qwen2":
            for name, width in (("q", q_width), ("k", kv_width), ("v", kv_width)):
                weights[p + f"self_attn.{name}_proj.bias"] = rand(width)
        if config["model_type"] == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
    return weights


# Sizes whose every input is whole groups of 128 (the tiny models' hidden size, 96, is not); its
# o_proj's columns split 64 + 64 inside one group.
WIDE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def with_tensors(model_dir: str | Path, out_dir: str | Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of `model_dir` at `out_dir` whose `tensors` replace or add stored ones (a corrupt file)."""
    model_dir, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, out / file.name)
    save_file(load_file(model_dir / "model.safetensors") | tensors, str(out / "model.safetensors"))
    return out

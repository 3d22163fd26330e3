"""A random-weights Llama model directory of a named geometry, written on the spot.

The GPU check's offline mode: a GPU machine lent for a first check often has no network and takes a
copy of the tree under 64 MiB, so it can neither fetch a model nor carry one. What it times depends
on the geometry (bytes read per token, KV bytes per token, head count), not on what the weights
learned, so seeded random weights of the real shapes stand in. The directory is what the loader
reads from any Hugging Face checkpoint: config.json, safetensors shards with their index, a small
byte-level BPE tokenizer.json (built here with the `tokenizers` library) and a chat template.

The vocabulary of the weights is the geometry's (128,256 rows for Llama 3, so the head reads what
it would); the tokenizer knows only its first few hundred ids, which is all the prompts need, and
decodes other ids to nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TOKENIZER_VOCAB = 512
# Embedding rows as small as Llama's initialisation makes them, and products scaled by 1/sqrt(fan-in)
# so that every block adds about as much as it reads: the blocks, not the embedding, then decide the
# next token, which depends on the whole context. (With a larger embedding, a tied head finds the
# input token itself and every step repeats it, which would hide a wrong cache or position.) Norm
# weights are ones.
EMBEDDING_STD = 0.02
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# config.json fields per size: Llama 3.2 1B and Llama 3.1 8B, and a tiny one for the CPU.
GEOMETRIES: dict[str, dict] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": TOKENIZER_VOCAB,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE | {"factor": 32.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE | {"factor": 8.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
    },
}
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# Words of the benchmarks' prompts (bench/prompts.py), so a prompt tokenizes to a chat's length.
CORPUS = [
    "Tell me fact about rivers bridges libraries volcanoes gardens trains comets bees.",
    "the lane host admits waiting requests, prefills their prompts and runs decode rounds over "
    "every live lane while the follower replays each message on its own shard of the weights",
    "user assistant system 0 1 2 3 4 5 6 7 8 9",
]


def model_config(size: str) -> dict:
    if size not in GEOMETRIES:
        raise ValueError(f"unknown random model size {size!r} (sizes: {', '.join(GEOMETRIES)})")
    return COMMON | GEOMETRIES[size]


def num_parameters(config: dict) -> int:
    return sum(math.prod(shape) for _, shape, _ in tensor_shapes(config))


def write_random_model(out_dir: str | Path, size: str, *, seed: int = 0, device: str = "cpu") -> Path:
    """The model of geometry `size` at `out_dir`: one safetensors shard per layer (and one for the
    embeddings, final norm and head), so writing never holds more than a layer; `device` draws the
    numbers (a GPU draws an 8B model's in seconds, a CPU core takes minutes)."""
    config = model_config(size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "add_bos_token": False})
    )
    shards: dict[int, list[tuple[str, tuple[int, ...], float]]] = {}
    for name, shape, std in tensor_shapes(config):
        shards.setdefault(_layer_of(name), []).append((name, shape, std))
    num_shards = len(shards)
    weight_map, total_bytes = {}, 0
    generator = torch.Generator(device=device).manual_seed(seed)
    for number, (_, entries) in enumerate(sorted(shards.items()), start=1):
        file = f"model-{number:05d}-of-{num_shards:05d}.safetensors"
        tensors = {name: _draw(shape, std, generator, device) for name, shape, std in entries}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, std) of every weight, in Hugging Face's Llama names; std 0 marks a norm (ones)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_width = config["num_attention_heads"] * head_dim
    kv_width = config["num_key_value_heads"] * head_dim
    shapes = [
        ("model.embed_tokens.weight", (vocab, hidden), EMBEDDING_STD),
        ("model.norm.weight", (hidden,), 0.0),
    ]
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (vocab, hidden), hidden**-0.5))
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,), 0.0),
            (p + "post_attention_layernorm.weight", (hidden,), 0.0),
            (p + "self_attn.q_proj.weight", (q_width, hidden), hidden**-0.5),
            (p + "self_attn.k_proj.weight", (kv_width, hidden), hidden**-0.5),
            (p + "self_attn.v_proj.weight", (kv_width, hidden), hidden**-0.5),
            (p + "self_attn.o_proj.weight", (hidden, q_width), q_width**-0.5),
            (p + "mlp.gate_proj.weight", (inter, hidden), hidden**-0.5),
            (p + "mlp.up_proj.weight", (inter, hidden), hidden**-0.5),
            (p + "mlp.down_proj.weight", (hidden, inter), inter**-0.5),
        ]
    return shapes


def _draw(shape: tuple[int, ...], std: float, generator: torch.Generator, device: str) -> torch.Tensor:
    if std == 0.0:
        return torch.ones(shape, dtype=torch.bfloat16)
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return values.mul_(std).to(torch.bfloat16).cpu().contiguous()


def _layer_of(name: str) -> int:
    """The shard a weight goes to: its layer's, and -1 (the first) for the rest."""
    parts = name.split(".")
    return int(parts[2]) if parts[1] == "layers" else -1


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer

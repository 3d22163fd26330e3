"""A synthetic mixture of experts and a dense twin with the same active parameters, for the speed figure.

Writes two random-weight checkpoints with a byte-level tokenizer: a Qwen3-MoE (`--experts` experts,
top `--top-k`, each `--expert-size` wide) and a Qwen3 whose MLP is top-k experts wide, the same
attention, embeddings and layers, so a decoded token reads the same number of weights in both.
Then, per model, rank 0's weight bytes at tp=2 in `--quantize` against half the checkpoint's
float32 bytes. The decode figures come from bench/concurrency.py on each directory:

    python -m bench.moe_models --out /tmp/moe                 # writes /tmp/moe/moe and /tmp/moe/dense
    python -m bench.concurrency --model /tmp/moe/moe --quantize int4 --streams 1 16
    python -m bench.concurrency --model /tmp/moe/dense --quantize int4 --streams 1 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from bench.common import finish, print_table  # noqa: E402
from tpserve.ranks.loader import load_rank_model  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def ascii_tokenizer() -> Tokenizer:
    """3 specials, then the 128 ASCII bytes (131 ids): whatever a random model emits decodes to
    text at once, so no reply's tokens wait in the text stream for the rest of a UTF-8 character."""
    vocab = {token: i for i, token in enumerate(SPECIALS)} | {_byte_char(b): 3 + b for b in range(128)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def _byte_char(byte: int) -> str:
    """The character the byte-level pre-tokenizer writes for an ASCII byte (GPT-2's table: the
    printable ones as themselves, the rest from U+0100 on, in order)."""
    unprintable = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return chr(256 + unprintable.index(byte)) if byte in unprintable else chr(byte)


def write_model(out: Path, config: dict, seed: int) -> int:
    """config.json, model.safetensors (float32, N(0, 0.02)) and the tokenizer; the file's bytes."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {
        "model.embed_tokens.weight": rand(config["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(q, hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q),
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
        }
        if "num_experts" in config:
            width = config["moe_intermediate_size"]
            tensors[p + "mlp.gate.weight"] = rand(config["num_experts"], hidden)
            for e in range(config["num_experts"]):
                s = f"{p}mlp.experts.{e}."
                tensors |= {
                    s + "gate_proj.weight": rand(width, hidden),
                    s + "up_proj.weight": rand(width, hidden),
                }
                tensors[s + "down_proj.weight"] = rand(hidden, width)
        else:
            width = config["intermediate_size"]
            tensors |= {
                p + "mlp.gate_proj.weight": rand(width, hidden),
                p + "mlp.up_proj.weight": rand(width, hidden),
            }
            tensors[p + "mlp.down_proj.weight"] = rand(hidden, width)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    ascii_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": SPECIALS[0]})
    )
    return sum(t.numel() * 4 for t in tensors.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=384)
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    base = {
        "vocab_size": 131, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 128, "head_dim": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 0, "torch_dtype": "float32",
        "intermediate_size": args.top_k * args.expert_size,
    }  # fmt: skip
    moe = base | {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.expert_size, "norm_topk_prob": True,
    }  # fmt: skip
    dense = base | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    rows = {}
    for name, config in (("moe", moe), ("dense", dense)):
        out = Path(args.out) / name
        file_bytes = write_model(out, config, seed=0)
        model = load_rank_model(
            out,
            tp_rank=0,
            tp_size=2,
            dtype=torch.float32,
            max_positions=256,
            row_tile=16,
            quantize=args.quantize,
        )
        rows[name] = {"dir": str(out), "checkpoint_bytes": file_bytes, "rank0_bytes": model.weight_bytes()}
        del model
    print_table(
        f"weights per rank at tp=2 ({args.quantize}) against half the float32 checkpoint",
        ["model", "checkpoint MB", "rank 0 MB", "rank 0 / half the checkpoint"],
        [
            [
                n,
                r["checkpoint_bytes"] / 1e6,
                r["rank0_bytes"] / 1e6,
                r["rank0_bytes"] / (r["checkpoint_bytes"] / 2),
            ]
            for n, r in rows.items()
        ],
    )
    return finish({"models": rows, "geometry": vars(args)}, args.json)


if __name__ == "__main__":
    sys.exit(main())

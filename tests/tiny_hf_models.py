"""Tiny random models that transformers writes itself: its own config class, its own `save_pretrained`.

So the checkpoint's names, fusions and config keys are the family's real ones (Phi-3's fused
qkv_proj, Mixtral's block_sparse_moe.experts.N.w1), not our reading of them. The weights are drawn
again at a larger scale than transformers' init (0.02 would leave every logit near zero, where a
wrong product hides), seeded, so a model is the same every time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import CHAT_TEMPLATE, build_tokenizer

transformers = __import__("pytest").importorskip("transformers")

VOCAB = build_tokenizer(320).get_vocab_size()
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# GLM-4.5's mixture (GLM-4.5V's text model too: tests/tiny_glm4v.py): a dense first layer, then 8
# experts in 4 groups (the best 2 kept, top 3 of theirs) of an odd width (18), two shared experts (36
# wide: 18 + 18 a piece), the routed weights scaled, q/k/v biases
GLM4_MOE = {
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 18,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "attention_bias": True,
}
FAMILIES = {
    "phi3": lambda **kw: transformers.Phi3Config(**(SMALL | kw)),
    # longrope within its original context: the short factors (head_dim 16: 8 of them)
    "phi3-longrope": lambda **kw: transformers.Phi3Config(
        **(SMALL | {"max_position_embeddings": 1024, "original_max_position_embeddings": 256} | kw),
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(8)],
            "long_factor": [4.0] * 8,
        },
    ),
    # Phi-4-mini's shape: rotary on 12 of 16 dims (partial_rotary_factor 0.75), longrope's short
    # factors for those 12 (6 of them) within the original context
    "phi4-mini": lambda **kw: transformers.Phi3Config(
        **(
            SMALL
            | {"max_position_embeddings": 1024, "original_max_position_embeddings": 256}
            | {"partial_rotary_factor": 0.75}
            | kw
        ),
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.5 * i for i in range(6)],
            "long_factor": [4.0] * 6,
        },
    ),
    # sliding windows of 8 tokens (tests/test_sliding_window.py): Mistral's on every layer, Qwen2's
    # from max_window_layers on, Qwen3's where layer_types says so
    "mistral-window": lambda **kw: transformers.MistralConfig(**(SMALL | {"sliding_window": 8} | kw)),
    "qwen2-window": lambda **kw: transformers.Qwen2Config(
        **(SMALL | {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1} | kw)
    ),
    "qwen3-window": lambda **kw: transformers.Qwen3Config(
        **(
            SMALL
            | {
                "num_hidden_layers": 3,
                "head_dim": 16,
                "sliding_window": 8,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            }
            | kw
        )
    ),
    # Gemma 3 text: local layers (window 8, base 10k) around a global one (base 1M, positions
    # scaled linearly by 2), query_pre_attn_scalar unlike head_dim, the final logits soft-capped
    "gemma3": lambda **kw: transformers.Gemma3TextConfig(
        **(
            SMALL
            | {
                "num_hidden_layers": 3,
                "head_dim": 16,
                "query_pre_attn_scalar": 24,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "final_logit_softcapping": 30.0,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                },
            }
            | kw
        )
    ),
    "mixtral": lambda **kw: transformers.MixtralConfig(
        **(SMALL | {"num_local_experts": 8, "num_experts_per_tok": 2} | kw)
    ),
    # Qwen3-MoE with a dense layer among the sparse ones (mlp_only_layers) and an odd expert width
    # (18: 9 + 9 columns a piece)
    "qwen3-moe": lambda **kw: transformers.Qwen3MoeConfig(
        **(
            SMALL
            | {
                "num_hidden_layers": 3,
                "head_dim": 16,
                "num_experts": 8,
                "num_experts_per_tok": 3,
                "moe_intermediate_size": 18,
                "norm_topk_prob": True,
                "mlp_only_layers": [1],
            }
            | kw
        )
    ),
    # Qwen2-MoE: a dense layer among the sparse ones, odd widths (experts 18: 9 + 9 a piece, the
    # shared expert 20: 10 + 10), q/k/v biases, the top 3 weights as the softmax left them
    "qwen2-moe": lambda **kw: transformers.Qwen2MoeConfig(
        **(
            SMALL
            | {
                "num_hidden_layers": 3,
                "num_experts": 8,
                "num_experts_per_tok": 3,
                "moe_intermediate_size": 18,
                "shared_expert_intermediate_size": 20,
                "mlp_only_layers": [1],
            }
            | kw
        )
    ),
    # gpt-oss: sliding (window 8) and full layers, sinks, biases, 4 experts top 2 of an odd width
    # (18: 9 + 9 a piece), yarn over an original context of 64 (max 256: factor 4)
    "gpt-oss": lambda **kw: transformers.GptOssConfig(
        **(
            SMALL
            | {
                "num_hidden_layers": 3,
                "head_dim": 16,
                "intermediate_size": 18,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 4.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 64,
                },
            }
            | kw
        )
    ),
    # GLM-4.5: a dense first layer, then 8 experts in 4 groups (the best 2 kept, top 3 of theirs) of
    # an odd width (18), two shared experts (36 wide: 18 + 18 a piece), the routed weights scaled,
    # q/k norms, q/k/v biases, rotary on half of each head
    "glm4-moe": lambda **kw: transformers.Glm4MoeConfig(
        **(SMALL | GLM4_MOE | {"head_dim": 16, "use_qk_norm": True} | kw)
    ),
}


def write_hf_model(out_dir: str | Path, family: str, seed: int = 0, **overrides) -> Path:
    """`family`'s tiny model at `out_dir`, written by transformers, with the tests' tokenizer."""
    out = Path(out_dir)
    config = FAMILIES[family](**overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            # norms' weights near one (gpt-oss's biases and sinks drawn as the weights are)
            if param.dim() == 1 and ("norm" in name or family != "gpt-oss"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * (1.0 if "embed_tokens" in name else 0.2))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's router: a correction that matters
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    model.save_pretrained(out)
    tokenizer = build_tokenizer(320)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "add_bos_token": False})
    )
    return out

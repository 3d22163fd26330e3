"""The sharding plan: which slice of every weight each rank holds.

The model is always cut into NUM_PIECES pieces (KV-head groups, MLP width, vocabulary). At tp=2
each rank holds one piece; at tp=1 one rank holds both and computes them one after the other,
summing the row-parallel partials in the same order and precision as the all-reduce would. So a
single rank runs exactly the arithmetic of two, and two ranks give the same tokens as one.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from tpserve.ranks.model_config import ModelConfig

NUM_PIECES = 2


class Split(enum.Enum):
    COLUMN = "column"  # output rows cut along dim 0; no communication after
    ROW = "row"  # input columns cut along dim 1; partial sums all-reduced
    VOCAB = "vocab"  # vocabulary rows cut along dim 0 (embedding and head)
    REPLICATED = "replicated"


# Weight name (after "model.layers.N." or "model.") -> (split, unit the cut counts in).
SHARDING_TABLE: dict[str, tuple[Split, str | None]] = {
    "embed_tokens.weight": (Split.VOCAB, "vocab"),
    "lm_head.weight": (Split.VOCAB, "vocab"),
    "self_attn.q_proj.weight": (Split.COLUMN, "q_heads"),
    "self_attn.q_proj.bias": (Split.COLUMN, "q_heads"),
    "self_attn.k_proj.weight": (Split.COLUMN, "kv_heads"),
    "self_attn.k_proj.bias": (Split.COLUMN, "kv_heads"),
    "self_attn.v_proj.weight": (Split.COLUMN, "kv_heads"),
    "self_attn.v_proj.bias": (Split.COLUMN, "kv_heads"),
    "self_attn.o_proj.weight": (Split.ROW, "q_heads"),
    "self_attn.o_proj.bias": (Split.REPLICATED, None),  # added once, after the reduce (gpt-oss)
    "self_attn.sinks": (Split.REPLICATED, None),  # [Hq]: each piece takes its heads' (gpt-oss)
    "self_attn.q_norm.weight": (Split.REPLICATED, None),
    "self_attn.k_norm.weight": (Split.REPLICATED, None),
    "mlp.gate_proj.weight": (Split.COLUMN, "intermediate"),
    "mlp.up_proj.weight": (Split.COLUMN, "intermediate"),
    "mlp.down_proj.weight": (Split.ROW, "intermediate"),
    # Mixtures of experts (tpserve/ranks/moe_config.py): the router whole on every rank; every expert's
    # intermediate dimension cut as the dense MLP's is (TP within experts, bench/moe_split.py).
    "mlp.gate.weight": (Split.REPLICATED, None),
    "mlp.experts.E.gate_proj.weight": (Split.COLUMN, "expert_intermediate"),
    "mlp.experts.E.up_proj.weight": (Split.COLUMN, "expert_intermediate"),
    "mlp.experts.E.down_proj.weight": (Split.ROW, "expert_intermediate"),
    # GLM-4.5's: the router's score correction whole, the shared expert cut as the dense MLP is
    "mlp.gate.e_score_correction_bias": (Split.REPLICATED, None),
    "mlp.shared_experts.gate_proj.weight": (Split.COLUMN, "shared_intermediate"),
    "mlp.shared_experts.up_proj.weight": (Split.COLUMN, "shared_intermediate"),
    "mlp.shared_experts.down_proj.weight": (Split.ROW, "shared_intermediate"),
    # Qwen2-MoE's: its shared expert cut as GLM's, the gate on its output whole
    "mlp.shared_expert.gate_proj.weight": (Split.COLUMN, "shared_intermediate"),
    "mlp.shared_expert.up_proj.weight": (Split.COLUMN, "shared_intermediate"),
    "mlp.shared_expert.down_proj.weight": (Split.ROW, "shared_intermediate"),
    "mlp.shared_expert_gate.weight": (Split.REPLICATED, None),
    "block_sparse_moe.gate.weight": (Split.REPLICATED, None),
    "block_sparse_moe.experts.E.w1.weight": (Split.COLUMN, "expert_intermediate"),
    "block_sparse_moe.experts.E.w3.weight": (Split.COLUMN, "expert_intermediate"),
    "block_sparse_moe.experts.E.w2.weight": (Split.ROW, "expert_intermediate"),
    # gpt-oss's (tpserve/ranks/stacked_experts.py): the router's bias, the gate and up biases cut as their
    # rows are, the down biases whole (added once, after the reduce)
    "mlp.router.weight": (Split.REPLICATED, None),
    "mlp.router.bias": (Split.REPLICATED, None),
    "mlp.experts.E.gate_proj.bias": (Split.COLUMN, "expert_intermediate"),
    "mlp.experts.E.up_proj.bias": (Split.COLUMN, "expert_intermediate"),
    "mlp.experts.down_proj_bias": (Split.REPLICATED, None),
    "input_layernorm.weight": (Split.REPLICATED, None),
    "post_attention_layernorm.weight": (Split.REPLICATED, None),
    "pre_feedforward_layernorm.weight": (Split.REPLICATED, None),  # Gemma 3's MLP norms
    "post_feedforward_layernorm.weight": (Split.REPLICATED, None),
    "post_self_attn_layernorm.weight": (Split.REPLICATED, None),  # GLM-4.1V's output norms
    "post_mlp_layernorm.weight": (Split.REPLICATED, None),
    "norm.weight": (Split.REPLICATED, None),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.experts\.\d+\.")  # every expert's weight has one rule


def split_evenly(total: int, num_parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges; earlier parts take the remainder (3 KV heads over 2 -> 2 + 1)."""
    base, extra = divmod(total, num_parts)
    bounds, start = [], 0
    for part in range(num_parts):
        size = base + (1 if part < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


@dataclass(frozen=True)
class Piece:
    """One piece's share: KV heads [kv_start, kv_end), MLP columns, vocabulary rows, and every
    expert's intermediate columns and the shared expert's (a mixture of experts)."""

    index: int
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    expert_intermediate: tuple[int, int] = (0, 0)
    shared_intermediate: tuple[int, int] = (0, 0)

    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def plan_pieces(config: ModelConfig) -> list[Piece]:
    kv = split_evenly(config.num_kv_heads, NUM_PIECES)
    mlp = split_evenly(config.intermediate_size, NUM_PIECES)
    vocab = split_evenly(config.vocab_size, NUM_PIECES)
    experts = split_evenly(config.moe.expert_size if config.moe else 0, NUM_PIECES)
    shared = split_evenly(config.moe.shared_size if config.moe else 0, NUM_PIECES)
    return [Piece(i, kv[i], mlp[i], vocab[i], experts[i], shared[i]) for i in range(NUM_PIECES)]


def pieces_of_rank(config: ModelConfig, tp_rank: int, tp_size: int) -> list[Piece]:
    if NUM_PIECES % tp_size:
        raise ValueError(f"tp must divide {NUM_PIECES} (got tp={tp_size})")
    per_rank = NUM_PIECES // tp_size
    return plan_pieces(config)[tp_rank * per_rank : (tp_rank + 1) * per_rank]


def rule_for(name: str) -> tuple[Split, str | None]:
    match = _LAYER_NAME.match(name)
    key = _EXPERT.sub(".experts.E.", match.group(2)) if match else name.removeprefix("model.")
    if key not in SHARDING_TABLE:
        raise KeyError(name)
    return SHARDING_TABLE[key]


def piece_range(config: ModelConfig, piece: Piece, unit: str) -> tuple[int, int]:
    """The rows (COLUMN, VOCAB) or columns (ROW) of a weight that belong to `piece`."""
    if unit == "vocab":
        return piece.vocab
    if unit == "intermediate":
        return piece.intermediate
    if unit == "expert_intermediate":
        return piece.expert_intermediate
    if unit == "shared_intermediate":
        return piece.shared_intermediate
    width = config.head_dim * (config.num_queries_per_kv if unit == "q_heads" else 1)
    return piece.kv_heads[0] * width, piece.kv_heads[1] * width

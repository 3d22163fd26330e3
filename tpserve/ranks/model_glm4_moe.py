"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): the decoder of "GLM-4.5: Agentic, Reasoning, and Coding
(ARC) Foundation Models" (Zhipu AI & Tsinghua, 2025) on one rank's pieces.

What it changes in the Llama-style decoder (tpserve/ranks/model.py), each where the report says:
- the first `first_k_dense_replace` layers keep a dense SwiGLU MLP; every later one is a mixture of
  experts whose router scores each expert by a sigmoid, chooses by score plus a learned correction
  ("loss-free balance routing"), in groups (`n_group`, `topk_group`), and weighs the chosen by their
  scores, renormalised and scaled by `routed_scaling_factor` (tpserve/kernels/moe.py route_grouped_sigmoid,
  the product in float32 as transformers computes it);
- a shared expert (`n_shared_experts` of them fused into one SwiGLU MLP) sees every token, its
  output added to the routed experts' sum: cut across the pieces as the dense MLP is, each piece's
  shared partial added to its routed partial before the one all-reduce (tpserve/ranks/moe.py);
- a partial rotary (`partial_rotary_factor`, half in the released models): rotate-half over a
  head's first dims only; q and k are reordered once at load so that every attention kernel serves
  it as a whole-head rotary whose resting pairs turn at rate zero (tpserve/kernels/rotary.py
  partial_rotary_order);
- biases on q, k and v (not o), and RMSNorm on q and k per head where `use_qk_norm`.
The multi-token-prediction layer the checkpoints carry past the last layer is not read.
"""

from __future__ import annotations

import dataclasses

import torch

from tpserve.kernels.rotary import partial_rotary_order
from tpserve.ranks.block_tensors import BlockValues
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.int8_tensors import Int8Values
from tpserve.ranks.model import TPModel


class Glm4MoeModel(TPModel):
    """TPModel builds the rest from the config (its grouped routers, the partial rotary's tables):
    only the heads' reorder comes first, before the weights are packed."""

    def __init__(self, config, weights, pieces, **options):
        if config.rotary_dim:
            _reorder_heads(config, weights, pieces)
        super().__init__(config, weights, pieces, **options)


def _reorder_heads(config, weights, pieces) -> None:
    """Every q and k head's dims (their projections' rows, biases and norms) in partial_rotary_order."""
    order = partial_rotary_order(config.head_dim, config.rotary_dim)
    for layer in range(config.num_layers):
        attn = f"model.layers.{layer}.self_attn."
        for kind in "qk":
            norm = f"{attn}{kind}_norm.weight"
            if norm in weights.replicated:
                weights.replicated[norm] = weights.replicated[norm][order]
            for piece, tensors in zip(pieces, weights.pieces):
                num_heads = piece.num_kv_heads() * (config.num_queries_per_kv if kind == "q" else 1)
                # [heads * D]: head h's dim j is its row h * D + order[j]
                rows = (torch.arange(num_heads).unsqueeze(1) * config.head_dim + order).flatten()
                for leaf in ("weight", "bias"):
                    name = f"{attn}{kind}_proj.{leaf}"
                    if name in tensors:
                        tensors[name] = _take_rows(tensors[name], rows, name)


def _take_rows(value, rows: torch.Tensor, name: str):
    """`value`'s rows in the order `rows` gives: a float tensor, or int8 values and their row scales,
    or blocks (each row its own blocks and scales)."""
    if isinstance(value, torch.Tensor):
        return value[rows.to(value.device)]
    if isinstance(value, (Int8Values, BlockValues)):
        fields = {
            field.name: getattr(value, field.name)[rows.to(getattr(value, field.name).device)]
            for field in dataclasses.fields(value)
            if isinstance(getattr(value, field.name), torch.Tensor)
        }
        return dataclasses.replace(value, **fields)
    raise ModelFileError(name, f"a partial rotary cannot reorder a {type(value).__name__}'s rows")

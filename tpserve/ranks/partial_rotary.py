"""A partial rotary (GLM-4.5's half of each head, Phi-4-mini's three quarters): rotate-half over a
head's first `rotary_dim` dims only, the rest passed through, as transformers computes it; or GLM-4.1V's,
whose rotating dims pair up interleaved, (2i, 2i + 1).

The kernels serve it as a whole-head rotary: q's and k's head dims (their projections' rows, biases
and norms) are reordered once at load, before packing, so that the rotating pairs are rotate-half's
(j, j + D/2) and the resting dims pair with each other at rate zero (cos 1, sin 0: exact;
tpserve/kernels/rotary.py partial_rotary_order). q.k is unchanged by a reorder both share, and v and
o are not touched, so the attention's output is the unreordered one's.
"""

from __future__ import annotations

import torch

from tpserve.kernels.rotary import partial_rotary_order
from tpserve.ranks.packing import rows_taken


def reorder_heads(config, weights, pieces) -> None:
    """Every q and k head's dims (their projections' rows, biases and norms) in partial_rotary_order."""
    order = partial_rotary_order(config.head_dim, config.rotary_dim, config.rotary_interleaved)
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
                        tensors[name] = rows_taken(tensors[name], rows)

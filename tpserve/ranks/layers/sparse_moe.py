"""A sparse layer's mixture of experts over this rank's pieces: the router (whole on every rank) and
each piece's slices of every expert (tpserve/ranks/moe.py), their partial sums reduced as a dense
MLP's are; where the family biases its experts' down products (gpt-oss), the routed biases are added
once after the reduce, so every rank adds the same."""

from __future__ import annotations

import torch

from tpserve.kernels.moe import routed_bias
from tpserve.kernels.tensor_parallel import sum_partials
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.moe import PieceExperts, Router


class SparseMoE:
    def __init__(self, shard: Shard, index: int):
        moe, replicated = shard.config.moe, shard.replicated
        self.router = Router(
            moe,
            replicated(moe.router_name(index)),
            replicated(moe.router_bias_name(index)) if moe.biased else None,
            replicated(moe.correction_name(index)) if moe.grouped else None,
            replicated(moe.shared_gate_name(index)) if moe.shared_gate else None,
        )
        self.pieces = [
            PieceExperts(moe, index, tensors, shard.quantize, shard.dtype) for tensors in shard.weights.pieces
        ]
        # [num_experts, hidden]: the experts' down biases (gpt-oss's), added after the reduce
        self.down_biases = replicated(moe.down_bias_name(index)) if moe.biased else None
        self.row_tile, self.group = shard.row_tile, shard.group

    def products(self) -> list:
        return [w for piece in self.pieces for w in piece.products()]

    def held(self) -> list:
        router = self.router
        whole = [router.weight, router.bias, router.correction, router.shared_gate, self.down_biases]
        return (
            self.products()
            + [b for piece in self.pieces for b in piece.biases()]
            + [w for w in whole if w is not None]
        )

    def forward(self, x: torch.Tensor, plan) -> torch.Tensor:
        """x: [rows, hidden] normed -> [rows, hidden], reduced over every rank (padding rows: none routed)."""
        routes = self.router.route(x, plan.num_tokens, self.row_tile)  # [T, k] each
        partial = sum_partials(
            (piece.forward(x, routes, plan.num_tokens, self.row_tile) for piece in self.pieces), x
        )
        if self.down_biases is None:
            return self.group.reduce(partial)
        biases = routed_bias(routes.weights, routes.experts, self.down_biases)  # [T, hidden]
        out = self.group.reduce(partial)
        out[: plan.num_tokens] += biases.to(out.dtype)
        return out

"""One layer's mixture of experts on one rank: the router (whole on every rank) and each piece's
slices of every expert (TP within experts: each expert's intermediate dimension cut into the
pieces, as the dense MLP's is; bench/moe_split.py measured it against expert parallelism)."""

from __future__ import annotations

import functools

import torch

from tpserve.kernels.linear import linear
from tpserve.kernels.moe import clamped_swiglu, expert_sum, route, route_top_logits, silu_glu
from tpserve.kernels.weight_formats import served_as
from tpserve.ranks.moe_config import MoeConfig
from tpserve.ranks.packing import fuse, pack_weight


class Router:
    """A sparse layer's router: every token's k experts and their weights, once per layer (every
    piece reads the same route)."""

    def __init__(self, moe: MoeConfig, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.moe, self.weight, self.bias = moe, weight, bias  # [num_experts, hidden], [num_experts]

    def route(self, x: torch.Tensor, num_real: int, row_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [rows, hidden], the first num_real real (the rest a pass's padding, not routed)."""
        logits = linear(x[:num_real], self.weight, self.bias, row_tile)  # [T, num_experts]
        if self.moe.softmax_top_logits:  # gpt-oss: a softmax over the k largest logits
            return route_top_logits(logits, self.moe.num_experts_per_tok)
        return route(logits, self.moe.num_experts_per_tok, self.moe.normalize_top_k)


class PieceExperts:
    """One piece's slice of every expert of a layer: fused gate/up [2*I_piece, hidden] and down
    [hidden, I_piece] each, packed in the format the dense MLP's would be."""

    def __init__(self, moe: MoeConfig, layer: int, tensors: dict, quantize: str, dtype: torch.dtype):
        formats = served_as(quantize)
        pack = functools.partial(pack_weight, kind=formats.linear, dtype=dtype)
        self.gate_ups, self.downs = [], []
        # gpt-oss: gate and up biases fused as their rows are ([2*I_piece] each), the clamped GLU
        self.gate_up_biases = [] if moe.biased else None
        swiglu = moe.swiglu
        self.glu = (
            silu_glu
            if swiglu is None
            else functools.partial(clamped_swiglu, alpha=swiglu.alpha, limit=swiglu.limit)
        )
        for expert in range(moe.num_experts):
            gate, up, down = moe.expert_names(layer, expert)
            self.gate_ups.append(pack(fuse(tensors, [gate, up])))
            self.downs.append(pack_weight(tensors.pop(down), formats.down, dtype))
            if moe.biased:
                self.gate_up_biases.append(fuse(tensors, list(moe.expert_bias_names(layer, expert))))

    def products(self) -> list:
        return [*self.gate_ups, *self.downs]

    def biases(self) -> list:
        return self.gate_up_biases or []

    def probed(self) -> list[tuple[str, object]]:
        """The products the start-up probe checks: one expert's (every expert's have its shapes)."""
        return [("expert gate_up", self.gate_ups[0]), ("expert down", self.downs[0])]

    def forward(self, x: torch.Tensor, routes, num_real: int, row_tile: int) -> torch.Tensor:
        """x: [rows, hidden] -> this piece's partial sum [rows, hidden] float32 (padding rows zero)."""
        weights, experts = routes
        partial = expert_sum(
            x[:num_real], weights, experts, self.gate_ups, self.downs, row_tile,
            gate_up_biases=self.gate_up_biases, glu=self.glu,
        )  # fmt: skip
        if num_real < x.shape[0]:
            partial = torch.nn.functional.pad(partial, (0, 0, 0, x.shape[0] - num_real))
        return partial

"""One layer's mixture of experts on one rank: the router (whole on every rank) and each piece's
slices of every expert (TP within experts: each expert's intermediate dimension cut into the
pieces, as the dense MLP's is; bench/moe_split.py measured it against expert parallelism), and a
shared expert's slice where the family has one (GLM-4.5, Qwen2-MoE: cut as the dense MLP is, its
partial sum added to the routed one before the pieces' sums are reduced; Qwen2-MoE's scaled first by
its gate, which the router computes once for every piece)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from tpserve.kernels.linear import linear
from tpserve.kernels.moe import (
    clamped_swiglu,
    expert_sum,
    route,
    route_grouped_sigmoid,
    route_top_logits,
    sigmoid_by_rows,
    silu_glu,
)
from tpserve.kernels.weight_formats import served_as
from tpserve.ranks.moe_config import MoeConfig
from tpserve.ranks.packing import fuse, pack_weight


class Routes(NamedTuple):
    """A sparse layer's route, the same for every piece."""

    weights: torch.Tensor  # [T, k] float32 (T: the pass's real rows)
    experts: torch.Tensor  # [T, k] int64
    shared_scale: torch.Tensor | None = None  # [rows, 1]: the shared expert's gate (Qwen2-MoE's)


class Router:
    """A sparse layer's router: every token's k experts and their weights, once per layer (every
    piece reads the same route), and the shared expert's gate where it has one."""

    def __init__(
        self,
        moe: MoeConfig,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ):
        if moe.grouped is not None:  # GLM-4.5: its router's product in float32, as transformers' is
            weight = weight.float()
        self.moe, self.weight, self.bias = moe, weight, bias  # [num_experts, hidden], [num_experts]
        self.correction = correction  # [num_experts] float32 (grouped routing's)
        # Qwen2-MoE's [1, hidden], held as [2, hidden] (a zero row below): a product with one output
        # runs as a matrix-vector product whose rows' bits change with their number, even in row tiles
        self.shared_gate = None if shared_gate is None else torch.nn.functional.pad(shared_gate, (0, 0, 0, 1))

    def route(self, x: torch.Tensor, num_real: int, row_tile: int) -> Routes:
        """x: [rows, hidden], the first num_real real (the rest a pass's padding, not routed; the
        shared expert's gate covers every row, as the shared expert does)."""
        weights, experts = self._choose(x, num_real, row_tile)
        if self.shared_gate is None:
            return Routes(weights, experts)
        logits = linear(x, self.shared_gate, None, row_tile, num_real)[:, :1]  # [rows, 1]
        return Routes(weights, experts, sigmoid_by_rows(logits))

    def _choose(self, x: torch.Tensor, num_real: int, row_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = self.moe.grouped
        if grouped is not None:
            logits = linear(x[:num_real].float(), self.weight, None, row_tile)
            return route_grouped_sigmoid(
                logits, self.correction, self.moe.num_experts_per_tok, grouped.num_groups,
                grouped.topk_group, self.moe.normalize_top_k, grouped.scale,
            )  # fmt: skip
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
        # the shared expert's slice (GLM-4.5, Qwen2-MoE): gate/up [2*S_piece, hidden], down [hidden, S_piece]
        self.shared_gate_up = self.shared_down = None
        if moe.shared_size:
            gate, up, down = moe.shared_names(layer)
            self.shared_gate_up = pack(fuse(tensors, [gate, up]))
            self.shared_down = pack_weight(tensors.pop(down), formats.down, dtype)

    def products(self) -> list:
        shared = [self.shared_gate_up, self.shared_down] if self.shared_gate_up is not None else []
        return [*self.gate_ups, *self.downs, *shared]

    def biases(self) -> list:
        return self.gate_up_biases or []

    def probed(self) -> list[tuple[str, object]]:
        """The products the start-up probe checks: one expert's (every expert's have its shapes)."""
        probed = [("expert gate_up", self.gate_ups[0]), ("expert down", self.downs[0])]
        if self.shared_gate_up is not None:
            probed += [
                ("shared expert gate_up", self.shared_gate_up),
                ("shared expert down", self.shared_down),
            ]
        return probed

    def forward(self, x: torch.Tensor, routes: Routes, num_real: int, row_tile: int) -> torch.Tensor:
        """x: [rows, hidden] -> this piece's partial sum [rows, hidden] float32 (padding rows: no
        expert's)."""
        partial = expert_sum(
            x[:num_real], routes.weights, routes.experts, self.gate_ups, self.downs, row_tile,
            gate_up_biases=self.gate_up_biases, glu=self.glu,
        )  # fmt: skip
        if num_real < x.shape[0]:
            partial = torch.nn.functional.pad(partial, (0, 0, 0, x.shape[0] - num_real))
        if self.shared_gate_up is None:
            return partial
        # the shared expert on every row, as the dense MLP (padding rows' results are never read)
        gate, up = linear(x, self.shared_gate_up, None, row_tile, num_real).chunk(2, dim=-1)
        shared = linear(silu_glu(gate, up), self.shared_down, None, row_tile, num_real).float()
        if routes.shared_scale is not None:  # each piece's slice scaled alike: the sum's scale
            shared = shared * routes.shared_scale
        return partial + shared

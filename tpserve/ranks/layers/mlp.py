"""A layer's dense MLP over this rank's pieces: down(act(gate(x)) * up(x)), gate/up fused.

Each piece owns a slice of the intermediate dimension: gate/up cut by rows (column-parallel), down
by columns (row-parallel), so a piece's down product is a partial sum, added over the pieces and
all-reduced (tpserve/kernels/tensor_parallel.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tpserve.kernels.linear import linear
from tpserve.kernels.tensor_parallel import sum_partials
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.packing import fuse, pack_weight


class PieceMLP:
    """One piece's slice: fused gate/up [2*I_piece, hidden] and down [hidden, I_piece]."""

    def __init__(self, shard: Shard, tensors: dict, index: int):
        mlp, formats = shard.layer_name(index, "mlp."), shard.formats
        pack = functools.partial(pack_weight, kind=formats.linear, dtype=shard.dtype)
        self.w_gate_up = pack(fuse(tensors, [mlp + "gate_proj.weight", mlp + "up_proj.weight"]))
        # (tpserve/kernels/weight_formats.py: down_proj may be served in another format; a checkpoint's
        # int8 down_proj stays int8)
        self.w_down = pack_weight(tensors.pop(mlp + "down_proj.weight"), formats.down, shard.dtype)

    def products(self) -> list:
        return [self.w_gate_up, self.w_down]

    def probed(self) -> list[tuple[str, object]]:
        """The products the start-up probe checks (tpserve/ranks/probe.py)."""
        return [("gate_up", self.w_gate_up), ("down", self.w_down)]


class DenseMLP:
    """activation: the gate's (SiLU: SwiGLU; Gemma's tanh-approximated GELU: GeGLU)."""

    def __init__(self, shard: Shard, index: int, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        self.pieces = [PieceMLP(shard, tensors, index) for tensors in shard.weights.pieces]
        self.activation, self.row_tile, self.group = activation, shard.row_tile, shard.group

    def products(self) -> list:
        return [w for piece in self.pieces for w in piece.products()]

    def held(self) -> list:
        return self.products()

    def forward(self, x: torch.Tensor, plan) -> torch.Tensor:
        """x: [rows, hidden] normed -> [rows, hidden], reduced over every rank."""
        return self.group.reduce(sum_partials((self._piece(piece, x, plan) for piece in self.pieces), x))

    def _piece(self, piece: PieceMLP, x: torch.Tensor, plan) -> torch.Tensor:
        gate, up = linear(x, piece.w_gate_up, None, self.row_tile, plan.num_tokens).chunk(2, dim=-1)
        return linear(self.activation(gate) * up, piece.w_down, None, self.row_tile, plan.num_tokens)

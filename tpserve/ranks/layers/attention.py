"""A layer's tensor-parallel attention: each piece's heads (fused q/k/v, o), the q and k norms,
the window, the sinks, the rotary it reads, and the reduce of the pieces' o partial sums.

Each piece owns whole KV heads and their query heads (tpserve/ranks/sharding.py): q/k/v is cut by
heads (column-parallel), o by its input columns (row-parallel), so a piece's o product is a partial
sum, added over the pieces and all-reduced (tpserve/kernels/tensor_parallel.py). How q and k rotate
and the KV is written is the kernel's concern (tpserve/kernels/attention_block.py).
"""

from __future__ import annotations

import functools

import torch

from tpserve.kernels.attention_block import rotate_store_attend
from tpserve.kernels.linear import linear
from tpserve.kernels.tensor_parallel import sum_partials
from tpserve.ranks.layers.norm import RMSNorm
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.packing import fuse, pack_weight
from tpserve.ranks.sharding import Piece


class PieceAttention:
    """One piece's heads: fused q/k/v [(Hq+2Hkv)*D, hidden] (and its bias), o [hidden, Hq*D], and
    its query heads' sink logits [Hq_piece] where the family has them."""

    def __init__(self, shard: Shard, piece: Piece, tensors: dict, index: int, sinks: torch.Tensor | None):
        self.num_kv_heads = piece.num_kv_heads()
        self.num_q_heads = self.num_kv_heads * shard.config.num_queries_per_kv
        attn = shard.layer_name(index, "self_attn.")
        # The fused copies replace the loaded ones, which are taken out of `tensors` so that no
        # second copy outlives loading (room is measured after it); so do quantized ones.
        pack = functools.partial(pack_weight, kind=shard.formats.linear, dtype=shard.dtype)
        self.w_qkv = pack(fuse(tensors, [attn + f"{n}_proj.weight" for n in "qkv"]))
        biased = shard.config.qkv_bias
        self.b_qkv = fuse(tensors, [attn + f"{n}_proj.bias" for n in "qkv"]) if biased else None
        self.w_o = pack(tensors.pop(attn + "o_proj.weight"))
        self.sinks = sinks

    def products(self) -> list:
        """The piece's computed weights (a piece holding no KV head computes no q/k/v nor o)."""
        return [self.w_qkv, self.w_o] if self.num_kv_heads else []

    def held(self) -> list:
        return [w for w in (self.w_qkv, self.b_qkv, self.w_o) if w is not None]


class Attention:
    """Layer `index`'s attention over this rank's pieces.

    scale: the scores' factor; window: the layer's sliding window (0: it sees every earlier token);
    local_rotary: the layer rotates by the family's rotary for its sliding layers (Gemma 3's base),
    read from the pass's plan; qk_norms: q's and k's norms, each head RMS-normed before rotating
    (Qwen3's, Gemma 3's); sinks: the family's sink logits [Hq] (gpt-oss), sliced per piece; o_bias:
    a bias on o added once after the reduce (gpt-oss), so every rank adds the same."""

    def __init__(
        self,
        shard: Shard,
        index: int,
        *,
        scale: float,
        window: int = 0,
        local_rotary: bool = False,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
        sinks: torch.Tensor | None = None,
        o_bias: torch.Tensor | None = None,
    ):
        group = shard.config.num_queries_per_kv
        self.index, self.scale, self.window, self.local_rotary = index, scale, window, local_rotary
        self.row_tile, self.group = shard.row_tile, shard.group
        self.pieces = [
            PieceAttention(
                shard,
                piece,
                tensors,
                index,
                None if sinks is None else sinks[piece.kv_heads[0] * group : piece.kv_heads[1] * group],
            )
            for piece, tensors in zip(shard.pieces, shard.weights.pieces)
        ]
        self.qk_norms = qk_norms  # [D] each, shared by every head
        self.sinks, self.o_bias = sinks, o_bias  # [Hq], [hidden]

    def products(self) -> list:
        return [w for piece in self.pieces for w in piece.products()]

    def held(self) -> list:
        """Every weight the attention holds (for a rank's byte count)."""
        norms = [norm.weight for norm in self.qk_norms or ()]
        whole = [w for w in (self.sinks, self.o_bias) if w is not None]
        return [w for piece in self.pieces for w in piece.held()] + norms + whole

    def forward(self, x: torch.Tensor, plan, kv) -> torch.Tensor:
        """x: [rows, hidden] normed -> the attention's output [rows, hidden], reduced over every rank."""
        attended = (
            self._attend(piece, x, plan, *kv.layer(local, self.index))
            for local, piece in enumerate(self.pieces)
            if piece.num_kv_heads
        )
        out = self.group.reduce(sum_partials(attended, x))
        return out if self.o_bias is None else out + self.o_bias

    def _attend(self, piece: PieceAttention, x, plan, pool_k, pool_v) -> torch.Tensor:
        """One piece's heads: its o product's partial sum [rows, hidden]."""
        qkv = linear(x, piece.w_qkv, piece.b_qkv, self.row_tile, plan.num_tokens)  # [rows, (Hq+2Hkv)*D]
        tables = plan.local_rotary if self.local_rotary else plan.rotary
        norms = None if self.qk_norms is None else tuple(norm.forward for norm in self.qk_norms)
        attended = rotate_store_attend(
            plan.kernel, qkv, piece.num_q_heads, norms, tables, plan.slots, pool_k, pool_v,
            plan.attention, self.scale, self.window, piece.sinks, plan.num_tokens,
        )  # fmt: skip
        return linear(attended, piece.w_o, None, self.row_tile, plan.num_tokens)

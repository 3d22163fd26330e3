"""Per-rank KV memory: a pool of token slots per local piece and layer, in blocks.

The live streams' pool is cut into blocks of `block_size` slots (block b: slots b*block_size ..
(b+1)*block_size-1); a stream's block table says which blocks hold its positions (tpserve/ranks/lane_tables.py),
and rank 0's lane host hands them out (tpserve/server/kv_blocks.py), cached prefixes included: this pool is
the only KV memory a rank has.
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, kv_heads: list[int], head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token of KV takes on a rank holding pieces with these KV-head counts."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * sum(kv_heads) * head_dim * element


class KVPool:
    """k/v[piece]: [num_layers, Hkv_piece, num_slots, D], head-major; the slots are num_blocks KV
    blocks of block_size tokens (block b: slots b*block_size .. (b+1)*block_size - 1), which a
    stream's block table names (tpserve/kernels/attention.py SpanView)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: list[int],
        head_dim: int,
        dtype: torch.dtype,
        device="cpu",
        *,
        block_size: int = 1,
    ):
        if block_size < 1 or num_slots % block_size:
            raise ValueError(f"{num_slots} KV slots are not whole blocks of {block_size}")
        self.num_slots, self.block_size, self.num_blocks = num_slots, block_size, num_slots // block_size
        self.k = [
            torch.zeros(num_layers, h, num_slots, head_dim, dtype=dtype, device=device) for h in kv_heads
        ]
        self.v = [
            torch.zeros(num_layers, h, num_slots, head_dim, dtype=dtype, device=device) for h in kv_heads
        ]
        # Every (piece, layer)'s views made once: a pass takes them with no op per layer.
        self._layers = [[(k[i], v[i]) for i in range(num_layers)] for k, v in zip(self.k, self.v)]

    def layer(self, piece: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[piece][layer]

    def copy_slots(self, source: int, target: int, num_slots: int) -> None:
        """Copy block `source`'s first `num_slots` slots into block `target`, every piece and layer:
        a prompt that matches a block only partly starts from the very bits its prefill would write."""
        src = slice(source * self.block_size, source * self.block_size + num_slots)
        dst = slice(target * self.block_size, target * self.block_size + num_slots)
        for pool in (*self.k, *self.v):
            pool[:, :, dst] = pool[:, :, src]

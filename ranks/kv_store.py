"""Per-rank KV memory: a pool of token slots per local piece and layer, in blocks.

The live streams' pool is cut into blocks of `block_size` slots (block b: slots b*block_size ..
(b+1)*block_size-1); a stream's block table says which blocks hold its positions (ranks/engine.py),
and rank 0's lane host hands them out (server/kv_blocks.py). The prompt cache's pool keeps whole
states in contiguous ranges (RangeAllocator, first fit and deterministic: every rank replaying the
same calls holds the same ranges).
"""

from __future__ import annotations

import bisect

import torch


class RangeAllocator:
    """Contiguous ranges of [0, capacity), first fit, lowest address first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._starts: list[int] = []  # sorted starts of allocated ranges
        self._sizes: dict[int, int] = {}

    @property
    def used(self) -> int:
        return sum(self._sizes.values())

    def allocate(self, size: int) -> int | None:
        start = self._find(size)
        if start is not None:
            bisect.insort(self._starts, start)
            self._sizes[start] = size
        return start

    def free(self, start: int) -> None:
        del self._sizes[start]
        self._starts.remove(start)

    def _find(self, size: int) -> int | None:
        if size <= 0:
            return None
        cursor = 0
        for start in self._starts:
            if start - cursor >= size:
                return cursor
            cursor = start + self._sizes[start]
        return cursor if self.capacity - cursor >= size else None


def kv_bytes_per_token(num_layers: int, kv_heads: list[int], head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token of KV takes on a rank holding pieces with these KV-head counts."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * sum(kv_heads) * head_dim * element


class KVPool:
    """k/v[piece]: [num_layers, Hkv_piece, num_slots, D]: head-major, so a lane's keys are a view."""

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
        self.block_size = block_size
        self.num_blocks = num_slots // block_size
        num_slots = self.num_blocks * block_size
        self.num_slots = num_slots
        self.k = [
            torch.zeros(num_layers, h, num_slots, head_dim, dtype=dtype, device=device) for h in kv_heads
        ]
        self.v = [
            torch.zeros(num_layers, h, num_slots, head_dim, dtype=dtype, device=device) for h in kv_heads
        ]
        self.allocator = RangeAllocator(num_slots)
        # Every (piece, layer)'s views made once: a pass takes them with no op per layer.
        self._layers = [[(k[i], v[i]) for i in range(num_layers)] for k, v in zip(self.k, self.v)]

    def layer(self, piece: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[piece][layer]

    def copy_slots(self, source: KVPool, source_slots, target_slots) -> None:
        """Copy the KV of `source_slots` of every layer from `source` (may be self) into this pool's
        `target_slots` (sequences of slot indices, the same length)."""
        device = self.k[0].device if self.k else "cpu"
        src = torch.as_tensor(list(source_slots), dtype=torch.int64, device=device)
        dst = torch.as_tensor(list(target_slots), dtype=torch.int64, device=device)
        for mine, theirs in zip(self.k + self.v, source.k + source.v):
            mine.index_copy_(2, dst, theirs.index_select(2, src))

"""Per-rank KV memory: a pool of token slots per local piece and layer, and its allocator.

A lane reserves one contiguous range of slots, so attention reads a view with no gather. The
allocator is first-fit and deterministic: every rank replaying the same calls holds the same ranges.
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
    """k/v[piece]: [num_layers, Hkv_piece, num_slots, D], head-major; the slots are num_blocks KV
    blocks of block_size tokens (block b: slots b*block_size .. (b+1)*block_size - 1), which a
    stream's block table names (kernels/attention.py SpanView)."""

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
        self.allocator = RangeAllocator(num_slots)
        # Every (piece, layer)'s views made once: a pass takes them with no op per layer.
        self._layers = [[(k[i], v[i]) for i in range(num_layers)] for k, v in zip(self.k, self.v)]

    def layer(self, piece: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[piece][layer]

    def copy(self, source: KVPool, source_start: int, target_start: int, num_tokens: int) -> None:
        """Copy num_tokens slots of every layer from `source` (may be self) into this pool."""
        src = slice(source_start, source_start + num_tokens)
        dst = slice(target_start, target_start + num_tokens)
        for mine, theirs in zip(self.k + self.v, source.k + source.v):
            mine[:, :, dst] = theirs[:, :, src]

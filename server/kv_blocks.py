"""The KV pool's blocks, as rank 0's scheduler books them: which are free, which a stream holds.

KV lives in fixed-size blocks of `block_size` tokens; a stream's block table lists the blocks that
hold its positions 0, 1, ... in order (position p in block table[p // block_size]). Any free block
serves any stream, so the pool never fragments: a stream that needs k blocks gets them whenever k
are free. Rank 0 alone decides which block goes where and sends the ids with each pass (ranks/wire.py),
so every rank's tables are the same by construction; the followers keep no allocator at all.

Blocks are handed out lowest id first, so the same calls give the same ids on every run.
Plain Python, no torch (STYLE 6): the fake backend and the real engine are booked the same way.
"""

from __future__ import annotations

import heapq


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens from position 0."""
    return -(-num_tokens // block_size)


class KVBlocks:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs blocks (num_blocks {num_blocks}, block_size {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap: the lowest free id first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        """`num_blocks` free blocks, lowest ids first. Raises when fewer are free (ask can_allocate)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"{num_blocks} KV blocks wanted, {len(self._free)} free")
        blocks = tuple(heapq.heappop(self._free) for _ in range(num_blocks))
        self._held.update(blocks)
        return blocks

    def free(self, blocks) -> None:
        for block in blocks:
            if block not in self._held:
                raise RuntimeError(f"freeing KV block {block}, which is not held")
            self._held.remove(block)
            heapq.heappush(self._free, block)

    def reset(self) -> None:
        """Every block free again (the engine broke: nothing it held matters any more)."""
        self._free = list(range(self.num_blocks))
        self._held.clear()

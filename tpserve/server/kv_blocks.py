"""The KV pool's blocks, as rank 0's scheduler books them: which are free, which streams hold them,
and which hold a prefix another prompt may share.

KV lives in fixed-size blocks of `block_size` tokens; a stream's block table lists the blocks that
hold its positions 0, 1, ... in order (position p in block table[p // block_size]). Any free block
serves any stream, so the pool never fragments: a stream that needs k blocks gets them whenever k
are free. Rank 0 alone decides which block goes where and sends the ids with each pass
(tpserve/ranks/wire.py), so every rank's tables are the same by construction; the followers keep no allocator
at all.

Prefix sharing (vLLM's prefix caching, nano-vllm's BlockManager): a full block whose KV is computed is
keyed by a digest of its parent block's key and its token ids (an image's positions hold the image's
key, requests.py cache_ids), so one key names one prefix. A prompt whose first blocks' keys are known
takes those very blocks into its table (a reference each) and prefills only what follows: sixteen
chats with one system prompt hold one copy of it. A block any stream references is never evicted (the
seed's borrower rule, per block). A cached block no stream references stays in the pool, free to be
taken again, and is reused for other KV, least recently released first, only when no plain free block
is left: no state copies, no budget beside the pool.

Blocks are handed out lowest id first, so the same calls give the same ids on every run.
Plain Python, no torch (STYLE 6): the fake backend and the real engine are booked the same way.
"""

from __future__ import annotations

import copy
import hashlib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens from position 0."""
    return -(-num_tokens // block_size)


def extend_keys(keys: list[bytes], token_ids: Sequence[int], num_blocks: int, block_size: int) -> None:
    """Extend `keys` (the keys of the first blocks of `token_ids`) to its first `num_blocks` full blocks."""
    for index in range(len(keys), num_blocks):
        digest = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
        for token in token_ids[index * block_size : (index + 1) * block_size]:
            digest.update(token.to_bytes(8, "little", signed=True))
        keys.append(digest.digest())


@dataclass(frozen=True)
class BlockStats:
    """A snapshot for metrics; the counters only grow."""

    lookups: int  # prompts looked up
    hits: int  # of those, the ones that shared at least one block
    hit_tokens: int  # prompt tokens shared blocks supplied
    evictions: int  # cached blocks reused for other KV
    num_cached: int  # blocks holding a prefix a later prompt may share
    num_used: int  # blocks streams hold
    num_blocks: int
    block_size: int


class KVBlocks:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs blocks (num_blocks {num_blocks}, block_size {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks))  # a heap of blocks holding nothing: the lowest id first
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recent first
        self._refs: dict[int, int] = {}  # held blocks: how many tables hold each
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._lookups = self._hits = self._hit_tokens = self._evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: the plain free ones and the unreferenced cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        """`num_blocks` blocks for new KV, lowest free ids first, then the least recently released
        cached ones (forgotten as they go). Raises when fewer are free (ask can_allocate)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"{num_blocks} KV blocks wanted, {self.num_free} free")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self._evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return tuple(blocks)

    def peek(self, num_blocks: int, plain: Sequence[int] = (), cached: Sequence[int] = ()) -> tuple[int, ...]:
        """The ids `allocate(num_blocks)` would return once `free` has left `plain` (uncached) and
        `cached` blocks unreferenced, in that order (a plan decides before it applies). Changes nothing."""
        ids = heapq.nsmallest(num_blocks, itertools.chain(self._free, plain))
        ids += itertools.islice(itertools.chain(self._idle, cached), num_blocks - len(ids))
        if len(ids) < num_blocks:
            raise RuntimeError(f"{num_blocks} KV blocks wanted, {len(ids)} free")
        return tuple(ids)

    def num_refs(self, block: int) -> int:
        """How many tables hold the block (0: free)."""
        return self._refs.get(block, 0)

    def is_cached(self, block: int) -> bool:
        """Whether the block holds a prefix a later prompt may share (freed, it stays findable)."""
        return block in self._key_of

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a cached block nobody references stays findable."""
        for block in blocks:
            refs = self._refs.get(block)
            if refs is None:
                raise RuntimeError(f"freeing KV block {block}, which is not held")
            if refs > 1:
                self._refs[block] = refs - 1
                continue
            del self._refs[block]
            if block in self._key_of:
                self._idle[block] = None
            else:
                heapq.heappush(self._free, block)

    def find(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """How many of the first blocks named by `keys` are cached, and how many of those are
        unreferenced (taking them costs that many free blocks). Changes nothing."""
        if not self.prefix_caching:
            return 0, 0
        num_found = num_idle = 0
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            num_found += 1
            num_idle += block in self._idle
        return num_found, num_idle

    def share(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """Take a reference to each cached block of the longest prefix of `keys` found; those blocks."""
        num_found, _ = self.find(keys)
        blocks = tuple(self._block_of[key] for key in keys[:num_found])
        for block in blocks:
            if block in self._idle:
                del self._idle[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
        self._lookups += 1
        self._hits += bool(blocks)
        self._hit_tokens += len(blocks) * self.block_size
        return blocks

    def note_copied(self, num_tokens: int, shared: bool) -> None:
        """Count a partly matching block's copied slots as prompt tokens the cache supplied (`shared`:
        share() already counted this prompt's hit)."""
        if num_tokens:
            self._hits += not shared
            self._hit_tokens += num_tokens

    def register(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Make held full blocks findable by their keys (blocks[i] holds the prefix keys[i] names).
        A key already naming another block keeps it (this block stays private)."""
        if not self.prefix_caching:
            return
        for block, key in zip(blocks, keys):
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block] = key
                self._block_of[key] = block

    def stats(self) -> BlockStats:
        return BlockStats(
            self._lookups,
            self._hits,
            self._hit_tokens,
            self._evictions,
            len(self._key_of),
            len(self._refs),
            self.num_blocks,
            self.block_size,
        )

    def scratch(self) -> KVBlocks:
        """A copy with the same free, cached and held blocks, for a plan to try admission on
        (tpserve/server/admit_plan.py): changing it changes nothing here."""
        clone = copy.copy(self)
        clone._free = list(self._free)
        clone._idle = OrderedDict(self._idle)
        clone._refs = dict(self._refs)
        clone._key_of = dict(self._key_of)
        clone._block_of = dict(self._block_of)
        return clone

    def reset(self) -> None:
        """Every block free again and nothing cached (the engine broke: nothing it held matters)."""
        self._free = list(range(self.num_blocks))
        self._idle.clear()
        self._refs.clear()
        self._key_of.clear()
        self._block_of.clear()

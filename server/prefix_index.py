"""Which kept token sequence shares the longest prefix with a prompt, found fast among thousands.

Each sequence is indexed under the blake2b digest of every block-aligned prefix it holds. A search walks
the prompt's block digests until one is missing (cost grows with the match, not with the prompt or the
number of entries), then extends into the next, partial block among the sequences holding the last one.
The prompt cache keeps its findable entries here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

__all__ = ["PrefixIndex", "to_tokens"]


def to_tokens(token_ids: Sequence[int]) -> array:
    return array("q", token_ids)  # a copy: a kept sequence must not change when the caller's list does


def _block_digests(tokens: array, num_blocks: int, block_size: int) -> Iterator[bytes]:
    """Digest k is that of tokens[:(k+1)*block_size]; lazy, so a search stops at its first miss."""
    raw = memoryview(tokens).cast("B")
    step = block_size * tokens.itemsize
    hasher = hashlib.blake2b(digest_size=16)
    for k in range(num_blocks):
        hasher.update(raw[k * step : (k + 1) * step])
        yield hasher.digest()


class PrefixIndex:
    """Token sequences by key; not thread-safe (the prompt cache holds its lock around every call)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self._block_size = block_size
        self._tokens: dict[int, array] = {}
        self._holders: dict[bytes, set[int]] = {}  # block-prefix digest -> keys holding that prefix

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, key: int) -> bool:
        return key in self._tokens

    def add(self, key: int, tokens: array) -> None:
        if key in self._tokens:
            raise ValueError(f"key {key} is already indexed")
        self._tokens[key] = tokens
        for digest in self._digests(tokens, len(tokens)):
            self._holders.setdefault(digest, set()).add(key)

    def remove(self, key: int) -> None:
        tokens = self._tokens.pop(key)
        for digest in self._digests(tokens, len(tokens)):
            holders = self._holders[digest]
            holders.discard(key)
            if not holders:
                del self._holders[digest]

    def longest_match(self, tokens: array, limit: int) -> tuple[int, int] | None:
        """(key, shared length) of the sequence sharing the most of tokens[:limit].

        None when none shares a whole block. Ties go to the shorter sequence, then the lower key.
        """
        holders: set[int] | None = None
        num_blocks = 0
        for digest in self._digests(tokens, limit):
            found = self._holders.get(digest)
            if found is None:
                break
            holders, num_blocks = found, num_blocks + 1
        if holders is None:
            return None
        start = num_blocks * self._block_size
        best: tuple[int, int, int] | None = None  # (-length, sequence length, key): smallest wins
        for key in holders:
            kept = self._tokens[key]
            # Past the shared blocks, at most one partial block can still match.
            end, length = min(len(kept), limit, start + self._block_size), start
            while length < end and kept[length] == tokens[length]:
                length += 1
            if best is None or (-length, len(kept), key) < best:
                best = (-length, len(kept), key)
        length, key = -best[0], best[2]
        # Belt and braces: a digest collision would hand out another prompt's state.
        return (key, length) if self._tokens[key][:start] == tokens[:start] else None

    def starting_with(self, prefix: array) -> list[int]:
        """Keys of the sequences whose tokens start with prefix."""
        candidates: set[int] | dict[int, array] = self._tokens
        for digest in self._digests(prefix, len(prefix)):
            candidates = self._holders.get(digest, set())
        return [
            key
            for key in candidates
            if len(self._tokens[key]) >= len(prefix) and self._tokens[key][: len(prefix)] == prefix
        ]

    def _digests(self, tokens: array, limit: int) -> Iterator[bytes]:
        return _block_digests(tokens, max(limit, 0) // self._block_size, self._block_size)

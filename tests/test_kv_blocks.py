"""The block book on its own: lowest ids first, references, prefix keys, least-recent eviction."""

from __future__ import annotations

import pytest

from tpserve.server.kv_blocks import KVBlocks, extend_keys


def keys_of(tokens, num_blocks, block_size=4):
    keys: list[bytes] = []
    extend_keys(keys, tokens, num_blocks, block_size)
    return keys


def test_blocks_go_lowest_first_and_come_back():
    book = KVBlocks(8, 4)
    assert book.allocate(3) == (0, 1, 2)
    book.free((1,))
    assert book.allocate(2) == (1, 3)
    assert book.num_free == 4 and book.num_used == 4
    with pytest.raises(RuntimeError, match="5 KV blocks wanted, 4 free"):
        book.allocate(5)
    with pytest.raises(RuntimeError, match="not held"):
        book.free((7,))


def test_a_key_names_a_whole_prefix_not_a_block_alone():
    # The same block of tokens after different parents has different keys.
    assert keys_of([1, 2, 3, 4, 9, 9, 9, 9], 2)[1] != keys_of([5, 6, 7, 8, 9, 9, 9, 9], 2)[1]
    assert keys_of([1, 2, 3, 4, 9, 9, 9, 9], 2) == keys_of([1, 2, 3, 4, 9, 9, 9, 9, 5], 2)


def test_shared_blocks_are_referenced_and_idle_ones_are_evicted_least_recent_first():
    book = KVBlocks(6, 4, prefix_caching=True)
    first, second = [1] * 8, [2] * 8
    a, b = book.allocate(2), book.allocate(2)
    book.register(a, keys_of(first, 2))
    book.register(b, keys_of(second, 2))
    assert book.share(keys_of(first, 2)) == a  # a second reference
    book.free(a)
    assert book.find(keys_of(first, 2)) == (2, 0), "still referenced: not idle"
    book.free(a)
    book.free(b)  # b released after a
    assert book.num_free == 6 and book.find(keys_of(first, 2)) == (2, 2)
    assert book.allocate(3) == (4, 5, a[0])  # plain free blocks first, then the oldest idle one
    assert book.find(keys_of(first, 2)) == (0, 0), "a's first block went: its prefix is gone"
    assert book.find(keys_of(second, 2)) == (2, 2)
    assert book.stats().evictions == 1


def test_peek_names_the_blocks_an_allocation_after_those_frees_would_take():
    """A step's plan chooses block ids before its closes run: peek, told which blocks the closes
    leave unreferenced (plain ones, then cached ones, in order), names what allocate then hands out,
    plain ones lowest first, then cached ones least recently released first; it changes nothing."""
    book = KVBlocks(10, 4, prefix_caching=True)
    first = book.allocate(4)  # 0..3: a stream whose first two blocks are cached
    book.register(first[:2], keys_of(range(8), 2))
    other = book.allocate(3)  # 4..6
    book.free(other[1:2])  # 5 free again
    planned = book.peek(6, plain=(first[3], first[2]), cached=(first[0], first[1]))
    assert book.stats().num_used == 6 and book.num_free == 4  # nothing changed
    book.free(first)  # what the plan's close does
    assert book.allocate(6) == planned == (2, 3, 5, 7, 8, 9)
    assert book.peek(2) == (0, 1)  # the cached ones, least recently released first
    with pytest.raises(RuntimeError, match="3 KV blocks wanted, 2 free"):
        book.peek(3)

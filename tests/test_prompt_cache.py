"""The prompt cache's lifetimes: borrowed entries survive, dead ones leave lookups at once, bytes add up."""

from __future__ import annotations

import pytest

from tpserve.server.prompt_cache import PromptCache

SYSTEM = list(range(100, 120))  # 20 tokens every prompt below starts with


def make_cache(budget_bytes: int = 100, **kwargs) -> tuple[PromptCache, list[int]]:
    """A cache counting one byte per token, blocks of 4, whose free_state calls land in the list."""
    freed: list[int] = []
    kwargs.setdefault("min_tokens", 4)
    kwargs.setdefault("block_size", 4)
    return PromptCache(budget_bytes, 1, free_state=freed.append, **kwargs), freed


def keep(cache: PromptCache, token_ids: list[int]) -> int:
    entry_id = cache.reserve(len(token_ids))
    assert entry_id is not None
    assert cache.commit(entry_id, token_ids)
    return entry_id


def assert_counts_add_up(cache: PromptCache) -> None:
    stats = cache.stats()
    assert stats.num_live_states == stats.num_entries + stats.num_dead + stats.num_pending
    assert stats.held_bytes <= stats.budget_bytes


def test_two_borrowers_and_a_failed_restore_keep_the_entry_until_the_last_release():
    cache, freed = make_cache()
    entry_id = keep(cache, SYSTEM)
    first, second = cache.lookup(SYSTEM + [1]), cache.lookup(SYSTEM + [2])
    assert first.entry_id == second.entry_id == entry_id
    cache.restore_failed(first)
    assert cache.lookup(SYSTEM + [3]) is None  # dead: lookups miss it at once
    assert (cache.stats().num_entries, cache.stats().num_dead, cache.stats().num_live_states) == (0, 1, 1)
    assert cache.stats().held_bytes == 20  # still charged while the second job restores from it
    assert freed == []
    cache.release(second)
    assert freed == [entry_id]
    assert (cache.stats().held_bytes, cache.stats().num_dead, cache.stats().num_live_states) == (0, 0, 0)


def test_forget_of_a_borrowed_entry_frees_it_at_its_release():
    cache, freed = make_cache()
    entry_id = keep(cache, SYSTEM)
    other_id = keep(cache, [7] * 8)
    borrow = cache.lookup(SYSTEM + [1])
    assert cache.forget(SYSTEM[:10]) == 1
    assert cache.lookup(SYSTEM + [1]) is None
    assert freed == [] and cache.stats().held_bytes == 28
    assert_counts_add_up(cache)
    cache.release(borrow)
    assert freed == [entry_id]
    assert cache.lookup([7] * 8 + [1]).entry_id == other_id  # forget took only entries with that prefix


def test_clear_frees_unborrowed_entries_now_and_borrowed_ones_at_release():
    cache, freed = make_cache()
    borrowed_id = keep(cache, SYSTEM)
    idle_id = keep(cache, [7] * 8)
    borrow = cache.lookup(SYSTEM + [1])
    assert cache.clear() == 2
    assert freed == [idle_id] and cache.stats().num_dead == 1 and cache.stats().held_bytes == 20
    cache.release(borrow)
    assert freed == [idle_id, borrowed_id] and cache.stats().held_bytes == 0


def test_eviction_passes_borrowed_entries_over():
    cache, freed = make_cache(budget_bytes=40)
    oldest = keep(cache, SYSTEM)
    newer = keep(cache, [7] * 20)
    borrow = cache.lookup(SYSTEM + [1])
    cache.release(cache.lookup([7] * 20 + [1]))  # newer is now the most recently used, and idle
    cache.lookup(SYSTEM + [2])  # a second borrow of the oldest, still held below
    cache.release(borrow)
    assert cache.reserve(20) is not None
    assert freed == [newer]  # the oldest is borrowed, so the newer goes
    assert cache.lookup(SYSTEM + [3]).entry_id == oldest
    assert cache.stats().evictions == 1


def test_reserve_with_everything_borrowed_fails_cleanly():
    cache, freed = make_cache(budget_bytes=40)
    keep(cache, SYSTEM)
    idle_id = keep(cache, [7] * 20)
    cache.lookup(SYSTEM + [1])
    assert cache.reserve(30) is None  # evicting the idle entry would not be enough: evict nothing
    assert freed == [] and cache.stats().num_entries == 2 and cache.stats().held_bytes == 40
    assert cache.stats().keeps_refused == 1
    assert cache.reserve(20) is not None  # enough: the idle one goes
    assert freed == [idle_id] and cache.stats().held_bytes == 40


def test_a_state_larger_than_the_budget_is_refused():
    cache, freed = make_cache(budget_bytes=10)
    assert cache.reserve(11) is None
    assert cache.stats().held_bytes == 0 and freed == []
    assert cache.keep_points(list(range(11))) == []  # keep_points does not even propose it


def test_eviction_is_least_recently_used_first():
    cache, freed = make_cache(budget_bytes=60)
    first = keep(cache, [1] * 20)
    second = keep(cache, [2] * 20)
    third = keep(cache, [3] * 20)
    cache.release(cache.lookup([1] * 21))  # the first is now the most recently used
    keep(cache, [4] * 20)
    keep(cache, [5] * 20)
    assert freed == [second, third]
    assert cache.lookup([1] * 21).entry_id == first


def test_longest_shared_prefix_wins_and_may_end_inside_an_entry():
    cache, _ = make_cache()
    short_id = keep(cache, SYSTEM[:8])
    long_id = keep(cache, SYSTEM)
    # Shares 10 tokens with the long entry (ending inside a block) and 8 with the short one.
    borrow = cache.lookup(SYSTEM[:10] + [1, 2, 3])
    assert (borrow.entry_id, borrow.num_tokens) == (long_id, 10)
    # Both share 8 tokens: the shorter entry is taken, so compact entries stay warm.
    borrow = cache.lookup(SYSTEM[:8] + [1, 2, 3])
    assert (borrow.entry_id, borrow.num_tokens) == (short_id, 8)
    assert cache.stats().hit_tokens == 18


def test_a_lookup_leaves_at_least_one_prompt_token_to_compute():
    cache, _ = make_cache()
    entry_id = keep(cache, SYSTEM)
    borrow = cache.lookup(SYSTEM)  # the same prompt again: restore all but its last token
    assert (borrow.entry_id, borrow.num_tokens) == (entry_id, 19)
    assert cache.lookup(SYSTEM[:4]) is None  # 3 tokens restorable: under min_tokens
    assert cache.lookup([]) is None
    assert (cache.stats().hits, cache.stats().misses) == (1, 2)


def test_pending_and_aborted_reservations_count_and_free_once():
    cache, freed = make_cache()
    entry_id = cache.reserve(20)
    assert cache.lookup(SYSTEM + [1]) is None  # pending: not findable before its commit
    assert (cache.stats().num_pending, cache.stats().num_live_states, cache.stats().held_bytes) == (1, 1, 20)
    cache.abort(entry_id)
    assert freed == [entry_id] and cache.stats().held_bytes == 0 and cache.stats().num_live_states == 0
    with pytest.raises(ValueError, match="not a pending reservation"):
        cache.commit(entry_id, SYSTEM)


def test_a_redundant_commit_is_freed_at_once():
    cache, freed = make_cache()
    kept_id = keep(cache, SYSTEM)
    twin_id = cache.reserve(20)  # an equal prompt kept at the same time
    assert cache.commit(twin_id, SYSTEM) is False
    assert freed == [twin_id] and cache.stats().num_entries == 1 and cache.stats().held_bytes == 20
    assert cache.lookup(SYSTEM + [1]).entry_id == kept_id


def test_misuse_is_refused_with_a_clear_error():
    cache, _ = make_cache()
    keep(cache, SYSTEM)
    borrow = cache.lookup(SYSTEM + [1])
    cache.release(borrow)
    with pytest.raises(ValueError, match="is not held"):
        cache.release(borrow)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        cache.reserve(3)
    entry_id = cache.reserve(8)
    with pytest.raises(ValueError, match="reserved 8 tokens"):
        cache.commit(entry_id, SYSTEM)
    with pytest.raises(ValueError, match="outside the prompt"):
        cache.keep_points(SYSTEM, boundaries=[21])
    with pytest.raises(ValueError, match="block_size"):
        PromptCache(100, 1, free_state=print, min_tokens=8, block_size=16)


def test_keep_points_prefer_the_whole_prompt_and_skip_what_is_covered():
    cache, _ = make_cache(budget_bytes=30)
    prompt = SYSTEM + list(range(10))  # 30 tokens
    assert cache.keep_points(prompt, boundaries=[20, 2, 28]) == [30, 28, 20]  # 2 < min_tokens
    keep(cache, SYSTEM)
    # The kept system block covers 20 tokens: only points reaching min_tokens further are worth it.
    assert cache.keep_points(prompt, boundaries=[20, 22, 28]) == [30, 28]
    assert cache.keep_points(SYSTEM + [1, 2]) == []
    assert cache.keep_points(prompt + [1]) == []  # 31 tokens never fit a budget of 30


def test_lookup_among_thousands_of_long_entries_finds_each_ones_prefix():
    cache = PromptCache(10**12, 1, free_state=lambda entry_id: None)
    system = list(range(50_000, 51_000))
    for i in range(1_000):
        keep(cache, system + [i] * 1_000 + list(range(1_000)))
    prompts = [system + [i] * 1_000 + list(range(6_000)) for i in range(0, 1_000, 5)]
    borrows = [cache.lookup(prompt) for prompt in prompts]
    assert all(borrow.num_tokens == 3_000 for borrow in borrows)

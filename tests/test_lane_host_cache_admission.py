"""Admission counts the prompt cache: a long prompt that is mostly cached is short once restored, so
it joins a joint prompt pass; one whose restore fails still prefills correctly, and a prompt long
even after its restore still goes in chunks. On the fake backend, whose every token depends on the
whole history, and which flags any pass longer than max_prefill_tokens."""

from __future__ import annotations

from fake_backend import EOS_IDS, FakeBackend, fake_detokenize, make_request, run_all

from tpserve.server.backend import PrefillItem
from tpserve.server.lane_host import LaneHost
from tpserve.server.prompt_cache import PromptCache

BYTES_PER_TOKEN = 10
MAX_PREFILL_TOKENS = 64

HISTORY = tuple(1 + (11 * i) % 37 for i in range(100))  # a cached chat history, longer than one pass


HISTORY_2 = tuple(2 + (13 * i) % 35 for i in range(100))  # another one


class RecordingBackend(FakeBackend):
    """The fake, noting (start, num_tokens, last) of every single-prompt prefill, whose restores
    of the entries in `failing_entries` fail."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prefill_calls: list[tuple[int, int, bool]] = []
        self.failing_entries: set[int] = set()

    def prefill(self, item: PrefillItem) -> int | None:
        self.prefill_calls.append((item.start, len(item.token_ids), item.last))
        return super().prefill(item)

    def restore(self, lane: int, entry_id: int, num_tokens: int) -> bool:
        self.fail_restores = entry_id in self.failing_entries
        return super().restore(lane, entry_id, num_tokens)

    def entry_of(self, history: tuple[int, ...]) -> int:
        (entry_id,) = [i for i, kept in self.states.items() if kept[: len(history)] == history]
        return entry_id


def make_warm_host(*histories: tuple[int, ...]) -> tuple[RecordingBackend, LaneHost, PromptCache]:
    """A host whose cache holds each history (kept by an earlier turn), with the records cleared."""
    backend = RecordingBackend(batched=True, max_prefill_tokens=MAX_PREFILL_TOKENS)
    cache = PromptCache(1000 * BYTES_PER_TOKEN, BYTES_PER_TOKEN, free_state=backend.evict)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, prompt_cache=cache)
    for history in histories or (HISTORY,):
        (reply,) = run_all(host, [host.submit(make_request(history + (1,), max_tokens=2))])
        assert reply.error is None, reply.error
        assert cache.cached_length(history + (9,)) == len(history)
    backend.prefill_calls.clear()
    return backend, host, cache


def second_turn(history: tuple[int, ...], index: int):
    """A turn after `history` with its own short new message; odd ones sampled with a seed."""
    seed = index if index % 2 else None
    return make_request(history + (9, 10 + index), max_tokens=6, ignore_eos=True, seed=seed)


def second_turns(num_turns: int) -> list:
    return [second_turn(HISTORY, i) for i in range(num_turns)]


def assert_nothing_held(backend: FakeBackend, cache: PromptCache) -> None:
    backend.assert_clean()
    assert cache.stats().num_pending == 0 and cache.stats().num_dead == 0
    assert len(backend.states) == cache.stats().num_live_states
    # A borrowed entry would survive a clear as a dead one, still held on the ranks.
    cache.clear()
    assert cache.stats().num_dead == 0 and cache.stats().num_live_states == 0 and backend.states == {}


def test_mostly_cached_long_prompts_share_one_joint_pass():
    backend, host, cache = make_warm_host()
    requests = second_turns(4)
    replies = run_all(host, [host.submit(request) for request in requests])
    assert backend.joint_passes == [4], "the four restored prompts went in one joint pass"
    assert backend.prefill_calls == []
    for request, reply in zip(requests, replies):
        assert reply.finished.usage.cached_tokens == len(HISTORY)
        assert reply == backend.solo_reply(request)
    assert_nothing_held(backend, cache)


def test_prompts_whose_restore_fails_are_admitted_together_and_still_prefill_in_passes_that_fit():
    backend, host, cache = make_warm_host()
    backend.failing_entries = {backend.entry_of(HISTORY)}
    requests = second_turns(4)
    streams = [host.submit(request) for request in requests]
    host.step()
    # Taken together on the cache's forecast; the first failed restore removed the entry, so each
    # prompt is long again: one chunks between decode rounds, the others went in chunks at once.
    assert len(backend.lanes) == 4
    replies = run_all(host, streams)
    assert backend.joint_passes == []
    assert all(num_tokens <= MAX_PREFILL_TOKENS for _, num_tokens, _ in backend.prefill_calls)
    assert cache.stats().restore_failures == 1
    for request, reply in zip(requests, replies):
        assert reply.finished.usage.cached_tokens == 0
        assert reply == backend.solo_reply(request)
    assert_nothing_held(backend, cache)


def test_in_one_admission_restored_prompts_pass_together_and_failed_ones_prefill_alone():
    backend, host, cache = make_warm_host(HISTORY, HISTORY_2)
    backend.failing_entries = {backend.entry_of(HISTORY_2)}
    requests = [second_turn(history, i) for i, history in enumerate([HISTORY, HISTORY_2] * 2)]
    streams = [host.submit(request) for request in requests]
    host.step()
    # All four were taken together; the two restored ones shared a pass, the two whose entry failed
    # went alone: one chunking between decode rounds, the other in chunks at once.
    assert len(backend.lanes) == 4 and backend.joint_passes == [2]
    replies = run_all(host, streams)
    assert all(num_tokens <= MAX_PREFILL_TOKENS for _, num_tokens, _ in backend.prefill_calls)
    assert [reply.finished.usage.cached_tokens for reply in replies] == [len(HISTORY), 0] * 2
    assert replies == [backend.solo_reply(request) for request in requests]
    assert_nothing_held(backend, cache)


def test_prompts_short_alone_but_too_long_together_after_failed_restores_split_their_joint_pass():
    # Three turns after a 40-token history, taken as mostly cached; the restore fails, so each is
    # 42 prompt tokens, short alone, but 126 together: more than one pass may carry.
    history = HISTORY[:40]
    backend, host, cache = make_warm_host(history)
    backend.failing_entries = {backend.entry_of(history)}
    requests = [second_turn(history, i) for i in range(3)]
    replies = run_all(host, [host.submit(request) for request in requests])
    assert backend.misuse == []
    assert all(size * 42 <= MAX_PREFILL_TOKENS for size in backend.joint_passes)
    assert all(num_tokens <= MAX_PREFILL_TOKENS for _, num_tokens, _ in backend.prefill_calls)
    assert replies == [backend.solo_reply(request) for request in requests]
    assert_nothing_held(backend, cache)


def test_prompts_long_even_after_the_cache_still_go_in_chunks_and_cached_ones_pass_them():
    backend, host, cache = make_warm_host()
    uncached = make_request(tuple(2 + (5 * i) % 31 for i in range(150)), max_tokens=4, seed=3)
    partly_cached = make_request(HISTORY + tuple(3 + i % 29 for i in range(80)), max_tokens=4)
    requests = [uncached, *second_turns(2), partly_cached]
    replies = run_all(host, [host.submit(request) for request in requests])
    # The uncached prompt chunks from 0; the two cached turns pass in one joint pass meanwhile; the
    # prompt with 80 new tokens after its 100 restored ones waits for the chunking place, then chunks.
    assert backend.joint_passes == [2]
    assert backend.prefill_calls == [(0, 64, False), (64, 64, False), (128, 22, True)] + [
        (100, 64, False),
        (164, 16, True),
    ]
    assert replies[3].finished.usage.cached_tokens == len(HISTORY)
    assert replies == [backend.solo_reply(request) for request in requests]
    assert_nothing_held(backend, cache)


def test_cached_length_forecasts_the_lookup_without_counting_or_borrowing():
    freed: list[int] = []
    cache = PromptCache(1000, 1, free_state=freed.append)
    entry_id = cache.reserve(40)
    cache.commit(entry_id, HISTORY[:40])
    assert cache.cached_length(HISTORY[:39] + (99,)) == 39
    assert cache.cached_length(HISTORY[:40]) == 39, "a lookup leaves one token to compute"
    assert cache.cached_length(HISTORY[:10] + (99,) * 30) == 0, "under min_tokens is a miss"
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (0, 0)
    borrow = cache.lookup(HISTORY[:39] + (99,))
    assert borrow is not None and borrow.num_tokens == 39
    cache.release(borrow)
    cache.cached_length(HISTORY[:39] + (99,))
    assert cache.clear() == 1 and freed == [entry_id], "no borrow held the entry past the clear"

"""The lane host with a prompt cache, on the fake backend whose every token depends on the whole
history: a restored prefix that was wrong in any token would change the reply."""

from __future__ import annotations

from fake_backend import EOS_IDS, FakeBackend, fake_detokenize, make_request, run_all

from tpserve.server.lane_host import LaneHost
from tpserve.server.prompt_cache import PromptCache

BYTES_PER_TOKEN = 10

SYSTEM = tuple(1 + (7 * i) % 39 for i in range(80))  # an 80-token shared prefix


def make_host(backend: FakeBackend, budget_tokens: int = 1000) -> tuple[LaneHost, PromptCache]:
    cache = PromptCache(budget_tokens * BYTES_PER_TOKEN, BYTES_PER_TOKEN, free_state=backend.evict)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, prompt_cache=cache)
    return host, cache


def cached_tokens(host: LaneHost, request) -> tuple[int, tuple[int, ...]]:
    stream = host.submit(request)
    (reply,) = run_all(host, [stream])
    assert reply.error is None, reply.error
    return reply.finished.usage.cached_tokens, reply.token_ids


def assert_books_balance(backend: FakeBackend, cache: PromptCache) -> None:
    # Every state the cache still counts lives in the backend, and no other.
    assert len(backend.states) == cache.stats().num_live_states
    assert cache.stats().held_bytes <= cache.stats().budget_bytes


def test_a_shared_prefix_is_restored_and_the_reply_equals_the_cold_one():
    backend = FakeBackend(room=4096)
    host, cache = make_host(backend)
    first = make_request(SYSTEM + (1, 2, 3), max_tokens=6)
    second = make_request(SYSTEM + (7, 8, 9, 10), max_tokens=6)
    assert cached_tokens(host, first)[0] == 0
    cached, tokens = cached_tokens(host, second)
    assert cached >= 64  # the shared prefix, block-aligned
    assert backend.num_restores == 1
    assert tokens == backend.solo_reply(second).token_ids
    backend_clean_lanes(backend)
    assert_books_balance(backend, cache)


def backend_clean_lanes(backend: FakeBackend) -> None:
    assert backend.misuse == [] and backend.lanes == {}


def test_a_failed_restore_falls_back_to_a_full_prefill_and_forgets_the_entry():
    backend = FakeBackend(room=4096)
    host, cache = make_host(backend)
    cached_tokens(host, make_request(SYSTEM + (1,), max_tokens=3))
    backend.fail_restores = True
    request = make_request(SYSTEM + (2,), max_tokens=5)
    cached, tokens = cached_tokens(host, request)
    assert cached == 0
    assert tokens == backend.solo_reply(request).token_ids
    assert cache.stats().restore_failures == 1
    assert_books_balance(backend, cache)


def test_a_keep_with_no_budget_left_fails_cleanly_and_the_request_still_runs():
    backend = FakeBackend(room=4096)
    host, cache = make_host(backend, budget_tokens=20)  # too small for any 80-token state
    request = make_request(SYSTEM + (3,), max_tokens=4)
    cached, tokens = cached_tokens(host, request)
    assert cached == 0 and tokens == backend.solo_reply(request).token_ids
    assert cache.stats().num_entries == 0 and backend.states == {}


def test_jobs_prefilled_together_each_restore_their_own_prefix():
    backend = FakeBackend(room=4096, batched=True, max_prefill_tokens=128)
    host, cache = make_host(backend)
    cached_tokens(host, make_request(SYSTEM + (1,), max_tokens=2))
    requests = [make_request(SYSTEM + (9, i), max_tokens=5) for i in range(4)]
    replies = run_all(host, [host.submit(r) for r in requests])
    assert backend.joint_passes, "the four prompts went in one joint pass"
    for request, reply in zip(requests, replies):
        assert reply.error is None, reply.error
        assert reply.finished.usage.cached_tokens >= 64
        assert reply.token_ids == backend.solo_reply(request).token_ids
    assert_books_balance(backend, cache)


def test_a_resumed_background_stream_restores_its_own_prompt():
    backend = FakeBackend(num_lanes=1, room=4096)
    host, cache = make_host(backend)
    background = make_request(SYSTEM + (5,), max_tokens=12, background=True)
    stream = host.submit(background)
    for _ in range(3):  # admitted, prefilled, decoding: it holds the only lane
        host.step()
    foreground = make_request((1, 2, 3), max_tokens=3)
    replies = run_all(host, [stream, host.submit(foreground)])
    assert [reply.error for reply in replies] == [None, None]
    assert replies[0].token_ids == backend.solo_reply(background).token_ids
    assert backend.num_restores >= 1
    assert_books_balance(backend, cache)

"""Prefix sharing by KV blocks on the fake backend, whose every token depends on the history it
reads back through each lane's block table: a shared block that held anything but the prompt's own
prefix, or a write into a block another lane holds, would change a reply or be refused."""

from __future__ import annotations

from fake_backend import FakeBackend
from fake_replies import make_request, run_all
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.server.lane_host import LaneHost

SYSTEM = tuple(1 + (7 * i) % 39 for i in range(80))  # an 80-token shared prefix: 10 blocks of 8


def make_host(backend: FakeBackend, **kwargs) -> LaneHost:
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, prefix_caching=True, **kwargs)


def chat(turn: int, max_tokens: int = 6, **kwargs):
    return make_request(SYSTEM + (1 + turn % 38, 2 + turn % 37, 3), max_tokens, ignore_eos=True, **kwargs)


def test_a_shared_prefix_is_shared_and_the_reply_equals_the_cold_one():
    backend = FakeBackend(room=4096)
    host = make_host(backend)
    first, second = chat(1), chat(2)
    (reply,) = run_all(host, [host.submit(first)])
    assert reply.finished.usage.cached_tokens == 0
    (reply,) = run_all(host, [host.submit(second)])
    assert reply.finished.usage.cached_tokens == 80  # ten whole blocks of the system prompt
    assert reply == backend.solo_reply(second)
    assert host.block_stats().hits == 1 and host.block_stats().hit_tokens == 80
    backend.assert_clean()


def test_sixteen_chats_with_one_system_prompt_hold_one_copy_of_it():
    backend = FakeBackend(num_lanes=16, room=16 * 128, max_prefill_tokens=64, batched=True)
    host = make_host(backend)
    requests = [chat(i, max_tokens=20) for i in range(16)]
    streams = [host.submit(request) for request in requests]
    peak = 0
    while any(stream.finished is None for stream in streams):
        host.step()
        peak = max(peak, host.stats().room_used)
    replies = run_all(host, streams)
    unshared = 16 * backend.block_size * -(-(len(SYSTEM) + 3 + 20) // backend.block_size)
    print(f"KV tokens held at the peak: {peak}; without sharing: {unshared}")
    # The first prompt goes in chunks; the others wait for its blocks rather than compute copies
    # of those not computed yet (their own tokens would fit one pass once the first chunk is cached).
    assert replies[0].finished.usage.cached_tokens == 0
    assert [r.finished.usage.cached_tokens for r in replies[1:]] == [80] * 15
    assert peak <= unshared - 15 * len(SYSTEM), "one copy of the system prompt"
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_short_prompts_arriving_together_wait_for_the_first_ones_prefix_blocks():
    # Each fits one pass, and nothing is cached yet: one joint pass over all four would compute four
    # copies of the system prompt. The first goes alone; the rest share its blocks in the next pass
    # (riding in the first one's decode round).
    backend = FakeBackend(num_lanes=4, room=4096, max_prefill_tokens=512, batched=True)
    host = make_host(backend)
    requests = [chat(i) for i in range(4)]
    replies = run_all(host, [host.submit(r) for r in requests])
    assert [r.finished.usage.cached_tokens for r in replies] == [0, 80, 80, 80]
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_block_in_use_is_never_evicted():
    # Room for about two streams: a stream sharing the system prompt keeps its blocks while others
    # churn through the rest of the pool.
    backend = FakeBackend(num_lanes=4, room=240, max_prefill_tokens=128, block_size=8)
    host = make_host(backend)
    (reply,) = run_all(host, [host.submit(chat(0))])
    holder = host.submit(chat(1, max_tokens=60))
    host.step()
    others = [make_request([5 + i] * 70, 20, ignore_eos=True) for i in range(6)]
    replies = run_all(host, [holder, *(host.submit(r) for r in others)])
    assert replies[0].finished.usage.cached_tokens == 80
    assert host.block_stats().evictions > 0
    assert replies == [backend.solo_reply(r) for r in [chat(1, max_tokens=60), *others]]
    backend.assert_clean()


def test_mostly_cached_long_prompts_share_one_joint_pass():
    backend = FakeBackend(num_lanes=4, room=4096, max_prefill_tokens=32, batched=True)
    host = make_host(backend)
    run_all(host, [host.submit(chat(0))])  # 80 tokens: in chunks of 32, then cached
    requests = [chat(i) for i in range(1, 4)]
    replies = run_all(host, [host.submit(r) for r in requests])
    assert backend.joint_passes[-1] == 3, "each only prefills its last 3 tokens"
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_preempted_stream_shares_its_own_blocks_when_resumed():
    backend = FakeBackend(num_lanes=2, room=200, context_size=200, block_size=8, max_prefill_tokens=128)
    host = make_host(backend)
    long = [make_request([3 + i] * 40, 70, ignore_eos=True, seed=i) for i in range(2)]
    replies = run_all(host, [host.submit(r) for r in long])
    assert host.stats().preempted > 0
    assert host.block_stats().hits > 0, "the preempted stream found its own prefix again"
    assert replies == [backend.solo_reply(r) for r in long]
    backend.assert_clean()


def test_without_prefix_caching_nothing_is_shared():
    backend = FakeBackend(room=4096)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    replies = run_all(host, [host.submit(chat(1)), host.submit(chat(2))])
    assert [r.finished.usage.cached_tokens for r in replies] == [0, 0]
    backend.assert_clean()

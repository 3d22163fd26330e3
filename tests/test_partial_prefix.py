"""A partly matching block on the fake backend: a prompt whose shared prefix ends inside a block a
live lane holds copies that block's computed slots into its own (vLLM's and SGLang's copy-on-write)
and counts them as cached. The fake reads every slot back through the lane's table, so a copy of the
wrong slots, or too many, changes the reply."""

from __future__ import annotations

from fake_backend import FakeBackend
from fake_replies import make_request, run_all
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.server.lane_host import LaneHost

SYSTEM = tuple(1 + (7 * i) % 39 for i in range(85))  # 10 whole blocks of 8, then 5 tokens of the 11th


def make_host(backend: FakeBackend) -> LaneHost:
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, prefix_caching=True)


def chat(turn: int, max_tokens: int = 6):
    return make_request(SYSTEM + (1 + turn % 38, 2 + turn % 37, 3), max_tokens, ignore_eos=True)


def prompt_computed(host: LaneHost, backend: FakeBackend, request) -> None:
    """Step until lane 0 (the first stream's) holds the whole prompt's KV (it is still answering)."""
    while 0 not in backend.lanes or backend.lanes[0].length < len(request.prompt_ids):
        host.step()


def test_a_prefix_ending_inside_a_live_block_is_copied_and_counted_cached():
    backend = FakeBackend(room=4096)
    host = make_host(backend)
    first, second = chat(1, max_tokens=30), chat(2)
    streams = [host.submit(first)]
    prompt_computed(host, backend, first)
    streams.append(host.submit(second))
    replies = run_all(host, streams)
    assert [r.finished.usage.cached_tokens for r in replies] == [0, 85]  # 80 shared + 5 copied
    assert backend.num_copies == 1
    assert replies == [backend.solo_reply(first), backend.solo_reply(second)]
    assert host.block_stats().hit_tokens == 85
    backend.assert_clean()


def test_fifteen_chats_after_the_first_copy_the_system_prompts_tail():
    backend = FakeBackend(num_lanes=16, room=16 * 128, max_prefill_tokens=64, batched=True)
    host = make_host(backend)
    requests = [chat(i, max_tokens=20) for i in range(16)]
    streams = [host.submit(requests[0])]
    prompt_computed(host, backend, requests[0])
    streams += [host.submit(request) for request in requests[1:]]
    replies = run_all(host, streams)
    assert [r.finished.usage.cached_tokens for r in replies] == [0] + [85] * 15
    assert backend.num_copies == 15
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_prompt_that_ends_where_the_match_does_still_computes_its_last_token():
    # The second prompt is the first's first 86 tokens: 85 match, and its last is computed anew.
    backend = FakeBackend(room=4096)
    host = make_host(backend)
    first = chat(1, max_tokens=30)
    second = make_request(first.prompt_ids[:86], 6, ignore_eos=True)
    streams = [host.submit(first)]
    prompt_computed(host, backend, first)
    streams.append(host.submit(second))
    replies = run_all(host, streams)
    assert replies[1].finished.usage.cached_tokens == 85
    assert replies == [backend.solo_reply(first), backend.solo_reply(second)]
    backend.assert_clean()


def test_a_whole_block_match_copies_all_but_its_last_slot():
    # Y's prompt blocks are cached; X computes the same prompt itself (it asks for its prompt's log
    # probabilities), so its blocks stay private; Z's prompt takes every free block and Y's first,
    # the least recently released; C then matches X's first block whole. Read as a whole block the
    # copy would be a shared block never written: C copies all but its last slot instead.
    backend = FakeBackend(room=12 * 8)
    host = make_host(backend)
    prompt = SYSTEM[:17]
    run_all(host, [host.submit(make_request(prompt, 2, ignore_eos=True))])
    reader = make_request(prompt, 40, ignore_eos=True, prompt_logprobs=0)
    streams = [host.submit(reader)]
    prompt_computed(host, backend, reader)
    run_all(host, [host.submit(make_request(tuple(range(100, 160)), 1, ignore_eos=True))])
    assert host.block_stats().evictions == 1
    late = make_request(prompt + (5, 6), 6, ignore_eos=True)
    streams.append(host.submit(late))
    replies = run_all(host, streams)
    assert replies == [backend.solo_reply(reader), backend.solo_reply(late)]
    assert replies[1].finished.usage.cached_tokens == 7
    backend.assert_clean()

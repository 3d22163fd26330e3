"""The prompt budget: a step prefills at most `max_prefill_tokens` prompt tokens, alone or together.

A joint pass never holds more prompt tokens than one pass may (the Backend contract), and a burst
of prompts delays the live streams' next decode round by about one pass rather than by the whole
burst; the step's first pass always goes, so the queue always moves. Every reply still equals its
solo run.
"""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from fake_replies import make_request, run_all
from fake_tokens import EOS_IDS, VOCAB_SIZE, fake_detokenize

from tpserve.server.lane_host import LaneHost

PROMPT_TOKENS = 20
MAX_PREFILL_TOKENS = 64  # three 20-token prompts fit in a pass, four do not


def tokens(first, num_tokens):
    """Prompt ids inside the fake's vocabulary (1..VOCAB_SIZE-1), starting at `first`."""
    return [(first + k) % (VOCAB_SIZE - 1) + 1 for k in range(num_tokens)]


def burst(num_requests, first=1):
    """Distinct prompts of PROMPT_TOKENS ids, every other one sampled."""
    return [
        make_request(tokens(first + 3 * i, PROMPT_TOKENS), 6, ignore_eos=True, seed=i if i % 2 else None)
        for i in range(num_requests)
    ]


def assert_solo(backend, requests, replies):
    assert [reply.reason for reply in replies] == ["length"] * len(requests)
    assert replies == [backend.solo_reply(request) for request in requests]


def prompt_tokens_between_decode_rounds(timeline):
    """Prompt tokens prefilled between one decode round and the next, for every such gap."""
    gaps, current = [], 0
    for kind, size in timeline:
        if kind == "decode":
            gaps.append(current)
            current = 0
        else:
            current += size
    return gaps + [current]


def test_a_burst_goes_in_joint_passes_of_what_one_pass_holds():
    backend = FakeBackend(batched=True, num_lanes=8, max_prefill_tokens=MAX_PREFILL_TOKENS)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    requests = burst(8)
    replies = run_all(host, [host.submit(request) for request in requests])
    # The first three in a joint pass; the rest ride in the decode rounds, one pass's worth a step.
    assert backend.joint_passes == [3] and backend.beside_round == [3, 2]
    assert_solo(backend, requests, replies)
    backend.assert_clean()


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "together"])
def test_a_burst_delays_a_live_stream_by_about_one_pass(batched):
    backend = FakeBackend(batched=batched, num_lanes=8, max_prefill_tokens=MAX_PREFILL_TOKENS)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    live = make_request([3, 1, 4], 30, ignore_eos=True)
    streams = [host.submit(live)]
    host.step()
    host.step()  # the live stream decodes
    requests = burst(7, first=20)
    streams += [host.submit(request) for request in requests]
    replies = run_all(host, streams)
    assert max(prompt_tokens_between_decode_rounds(backend.timeline)) <= MAX_PREFILL_TOKENS
    # All seven did get in: three passes' worth, a decode round of the live stream after each.
    prefills_after_burst = [size for kind, size in backend.timeline[3:] if kind == "prefill"]
    assert sum(prefills_after_burst) == 7 * PROMPT_TOKENS
    assert_solo(backend, [live, *requests], replies)
    backend.assert_clean()


def test_a_prompt_of_a_whole_pass_still_goes_first_in_its_step():
    backend = FakeBackend(batched=True, num_lanes=4, max_prefill_tokens=MAX_PREFILL_TOKENS)
    host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
    whole = make_request(tokens(1, MAX_PREFILL_TOKENS), 4, ignore_eos=True)
    short = burst(2, first=30)
    streams = [host.submit(request) for request in [whole, *short]]
    replies = run_all(host, streams)
    assert backend.timeline[0] == ("prefill", MAX_PREFILL_TOKENS)
    assert backend.timeline[1][0] == "decode", "the rest of the burst waits for the next step"
    assert backend.beside_round == [2], "then rides in the next step's decode round"
    assert_solo(backend, [whole, *short], replies)
    backend.assert_clean()

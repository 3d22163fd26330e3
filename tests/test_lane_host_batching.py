"""Batched prompt passes: several queued prompts prefilled together in one prefill_many.

Every reply must equal its own solo run whether its prompt went alone, in a joint pass, or alone
after a joint pass was refused or failed; one stream's refusal never takes the others down.
"""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from fake_replies import make_request, run_all
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.server.backend import PrefillItem
from tpserve.server.lane_host import LaneHost


def make_host(backend, **kwargs):
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, **kwargs)


def requests_from(firsts, max_tokens=8):
    """One request per first token; every other one sampled with a seed."""
    return [
        make_request([first, first + 2, first + 1], max_tokens, ignore_eos=True, seed=None if i % 2 else i)
        for i, first in enumerate(firsts)
    ]


def run_requests(host, requests):
    return run_all(host, [host.submit(request) for request in requests])


def test_four_queued_requests_share_one_prompt_pass():
    backend = FakeBackend(batched=True)
    requests = requests_from([1, 5, 9, 13])
    replies = run_requests(make_host(backend), requests)
    assert backend.joint_passes == [4] and backend.num_prefills == 0
    assert replies == [backend.solo_reply(r) for r in requests]
    assert all(reply.num_prefilled_events == 1 for reply in replies)
    backend.assert_clean()


def test_six_requests_on_four_lanes_fill_the_free_lanes_in_one_pass_and_the_rest_after():
    backend = FakeBackend(batched=True, num_lanes=4)
    requests = requests_from([1, 4, 7, 10, 13, 16])
    replies = run_requests(make_host(backend), requests)
    assert backend.joint_passes == [4, 2], "the last two shared a pass once two lanes freed together"
    assert backend.num_prefills == 0
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_pass_too_big_for_the_backend_falls_back_alone_and_later_passes_take_what_fits():
    backend = FakeBackend(batched=True, num_lanes=4, max_batch_streams=2)
    host = make_host(backend)
    first = requests_from([1, 4, 7, 10])
    assert run_requests(host, first) == [backend.solo_reply(r) for r in first]
    assert backend.refused_passes == [4] and backend.num_prefills == 4 and backend.joint_passes == []
    later = requests_from([13, 16, 19, 22])
    assert run_requests(host, later) == [backend.solo_reply(r) for r in later]
    # Two in a joint pass; the other two ride in those two's first decode round, as one pass holds.
    assert backend.joint_passes == [2] and backend.beside_round == [2] and backend.refused_passes == [4]
    backend.assert_clean()


@pytest.mark.parametrize("refuse", [False, True], ids=["pass-raises", "pass-refused"])
def test_one_request_the_backend_refuses_fails_alone_and_the_other_replies_are_kept(refuse):
    backend = FakeBackend(batched=True)
    backend.poisoned_prompts = {9}
    backend.refuse_poisoned_passes = refuse
    requests = requests_from([1, 5, 9, 13])
    replies = run_requests(make_host(backend), requests)
    assert (backend.refused_passes, backend.failed_passes) == (([4], []) if refuse else ([], [4]))
    assert replies[2].reason == "error" and "prefill failed" in replies[2].error
    for index in (0, 1, 3):
        assert replies[index] == backend.solo_reply(requests[index])
    backend.assert_clean()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_pass_that_raises_leaves_no_participant_prefilled_and_solo_retries_succeed(where):
    backend = FakeBackend(batched=True, num_lanes=4)
    backend.raise_in_pass_at = where
    host = make_host(backend)
    # Nothing decodes (else the prompts would ride in its round): a joint pass of their own.
    joint = requests_from([1, 5, 9])
    streams = [host.submit(request) for request in joint]
    host.step()
    assert backend.failed_passes == [3]
    # The solo retries start at position 0 on each lane; the fake flags any leftover state.
    assert backend.num_prefills == 3 and backend.misuse == []
    replies = run_all(host, streams)
    assert replies == [backend.solo_reply(r) for r in joint]
    backend.assert_clean()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_fake_rolls_back_every_participant_including_the_failing_one(where):
    backend = FakeBackend(batched=True, num_lanes=4)
    backend.raise_in_pass_at = where
    greedy = SamplingParams()
    for lane in range(4):
        backend.open(lane, (), 0)
    assert backend.prefill(PrefillItem(3, 0, (7, 8), True, greedy, blocks=(3,))) is not None
    with pytest.raises(RuntimeError, match="participant"):
        backend.prefill_many(
            [PrefillItem(lane, 0, (lane + 1, 2), True, greedy, blocks=(lane,)) for lane in range(3)]
        )
    assert [(backend.lanes[lane].length, backend.lanes[lane].table) for lane in range(3)] == [(0, [])] * 3
    assert backend.lanes[3].length == 2 and backend.lanes[3].table == [3], "an unrelated lane is untouched"


def test_a_joint_pass_then_one_streams_first_token_error_keeps_the_others_replies():
    backend = FakeBackend(batched=True)
    backend.bad_first_token_prompts = {5}
    requests = requests_from([1, 5, 9, 13])
    replies = run_requests(make_host(backend), requests)
    assert backend.joint_passes == [4]
    assert replies[1].reason == "error" and "could not decode token" in replies[1].error
    for index in (0, 2, 3):
        assert replies[index] == backend.solo_reply(requests[index])
    backend.assert_clean()


def test_batching_can_be_turned_off():
    backend = FakeBackend(batched=True)
    requests = requests_from([1, 5, 9, 13])
    replies = run_requests(make_host(backend, batch_prefill=False), requests)
    assert backend.joint_passes == [] and backend.num_prefills == 4
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_prompt_that_needs_chunks_is_never_put_in_a_joint_pass():
    backend = FakeBackend(batched=True, num_lanes=5, max_prefill_tokens=8)
    requests = [
        *requests_from([1, 5]),
        make_request(list(range(1, 21)), 6, seed=2),  # 20 tokens: three chunks
        *requests_from([9, 13]),
    ]
    replies = run_requests(make_host(backend), requests)
    # The first two in a joint pass, that step's one pass; the long one's three chunks and the last
    # two ride in the decode rounds after it (a chunk is never part of a joint pass of whole prompts).
    assert backend.joint_passes == [2] and backend.beside_round == [3, 1, 1]
    prefills = [size for kind, size in backend.timeline if kind == "prefill"]
    assert prefills == [6, 8, 3, 3, 8, 4], "chunks of 8, 8 and 4; the last two whole, beside the first"
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_resumed_background_stream_can_share_a_joint_pass():
    backend = FakeBackend(batched=True, num_lanes=2)
    host = make_host(backend)
    background = [
        make_request([1, 2], 16, ignore_eos=True, background=True),
        make_request([3, 4], 16, ignore_eos=True, background=True, seed=8),
    ]
    streams = [host.submit(request) for request in background]
    for _ in range(3):
        host.step()
    urgent = requests_from([20, 24], max_tokens=3)
    streams += [host.submit(request) for request in urgent]
    replies = run_all(host, streams)
    assert backend.joint_passes == [2, 2, 2], "first the background pair, then the urgent, then the resume"
    assert replies == [backend.solo_reply(r) for r in [*background, *urgent]]
    backend.assert_clean()

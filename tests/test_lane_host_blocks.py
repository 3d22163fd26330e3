"""KV blocks on the fake backend: a request that cannot fit yet waits, never fails; streams that
outgrow the pool are preempted (newest first, background before foreground) and recomputed, each
reply still equal to its solo run; and the seed's joint-pass contracts.

The fake holds KV in blocks and reads every lane's history back through its block table, so a block
given to two streams, or a preempted stream resumed at the wrong place, changes a reply.
"""

from __future__ import annotations

import random

from fake_backend import FakeBackend
from fake_replies import make_request, read_reply, run_all, step_until_finished
from test_lane_host import make_host

from tpserve.server.requests import CANCELLED


def request_of(first: int, num_prompt: int, num_reply: int, **kwargs):
    prompt = [1 + (first + k) % 38 for k in range(num_prompt)]
    return make_request(prompt, num_reply, ignore_eos=True, **kwargs)


def test_a_request_that_does_not_fit_yet_waits_and_is_served_exactly():
    # The reproduction: 4 lanes x context 25, room 100. A(20) B(25) C(20) D(25) run, A and
    # C end; E needs 25 of the 50 free: with contiguous ranges it was refused, with blocks it runs.
    backend = FakeBackend(num_lanes=4, room=100, context_size=25, block_size=5)
    host = make_host(backend)
    shapes = {"A": (10, 10), "B": (10, 15), "C": (10, 10), "D": (10, 15), "E": (10, 15)}
    requests = {name: request_of(i * 7, *shape) for i, (name, shape) in enumerate(shapes.items())}
    streams = {name: host.submit(requests[name]) for name in "ABCD"}
    step_until_finished(host, [streams["A"], streams["C"]])
    streams["E"] = host.submit(requests["E"])
    replies = dict(zip(streams, run_all(host, list(streams.values()))))
    for name, reply in replies.items():
        assert reply.reason == "length", (name, reply.error)
        assert reply == backend.solo_reply(requests[name]), name
    backend.assert_clean()


def test_streams_that_outgrow_the_pool_are_preempted_and_still_equal_their_solo_runs():
    # 8 lanes, but blocks for about two whole replies: every stream fits alone, not all at once.
    backend = FakeBackend(num_lanes=8, room=96, context_size=64, block_size=4, max_prefill_tokens=16)
    host = make_host(backend)
    requests = [request_of(i * 5, 6 + i, 30, seed=None if i % 2 else i) for i in range(8)]
    replies = run_all(host, [host.submit(request) for request in requests])
    assert host.stats().preempted > 0, "the pool was meant to run out"
    for request, reply in zip(requests, replies):
        assert reply.reason == "length", reply.error
        assert reply == backend.solo_reply(request)
    backend.assert_clean()


def test_background_streams_are_preempted_before_foreground_ones():
    backend = FakeBackend(num_lanes=4, room=48, context_size=48, block_size=4)
    host = make_host(backend)
    background = [request_of(3, 4, 18, background=True), request_of(9, 4, 18, background=True)]
    foreground = [request_of(15, 4, 18), request_of(21, 4, 18)]
    streams = [host.submit(r) for r in background]
    host.step()  # the background streams start first
    streams += [host.submit(r) for r in foreground]
    order = []
    while len(order) < len(streams):
        host.step()
        order += [i for i, s in enumerate(streams) if s.finished is not None and i not in order]
    assert host.stats().preempted > 0
    assert set(order[:2]) == {2, 3}, f"the foreground streams finish first, got {order}"
    for request, reply in zip(background + foreground, map(read_reply, streams)):
        assert reply == backend.solo_reply(request)
    backend.assert_clean()


def test_a_randomized_memory_bound_load_refuses_nothing_and_every_reply_equals_its_solo_run():
    rng = random.Random(29)
    backend = FakeBackend(num_lanes=16, room=256, context_size=128, block_size=8, max_prefill_tokens=32)
    backend.batches_prompts = True
    host = make_host(backend)
    requests = [
        request_of(rng.randrange(40), rng.randrange(1, 70), rng.randrange(1, 50), seed=rng.choice([None, 3]))
        for _ in range(48)
    ]
    streams = []
    for request in requests:
        streams.append(host.submit(request))
        for _ in range(rng.randrange(3)):
            host.step()
    replies = run_all(host, streams)
    assert [reply.error for reply in replies] == [None] * len(requests)
    for request, reply in zip(requests, replies):
        assert reply == backend.solo_reply(request)
    backend.assert_clean()


def test_a_joint_pass_takes_at_most_16_prompts():
    # The seed's cap: the fake records a pass over more than 16 prompts as misuse.
    backend = FakeBackend(num_lanes=24, batched=True, max_prefill_tokens=200, max_batch_streams=24)
    host = make_host(backend)
    requests = [request_of(i, 3, 2) for i in range(24)]
    replies = run_all(host, [host.submit(r) for r in requests])
    assert max(backend.joint_passes) == 16
    assert replies == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_a_refused_joint_pass_does_not_shrink_later_passes_for_good():
    backend = FakeBackend(num_lanes=16, batched=True, max_prefill_tokens=200)
    backend.poisoned_prompts = {37}
    backend.refuse_poisoned_passes = True
    host = make_host(backend)
    first = [request_of(36, 3, 2)] + [request_of(i, 3, 2) for i in range(7)]  # the first one is refused
    run_all(host, [host.submit(r) for r in first])
    assert backend.refused_passes, "the joint pass with the poisoned prompt was refused"
    for _ in range(3):  # bursts of 16: the joint passes grow back to the whole burst
        later = [request_of(i, 3, 2) for i in range(16)]
        run_all(host, [host.submit(r) for r in later])
    assert backend.joint_passes[-1] == 16, backend.joint_passes


def test_a_job_cancelled_between_take_and_setup_is_never_launched():
    """The plan named three jobs to take; the second is cancelled just as it leaves the queue: it
    gets no lane, the plan is made again without it (the third waits a step), and the others'
    replies equal their solo runs."""
    backend = FakeBackend(batched=True)
    host = make_host(backend)
    requests = [make_request([first, first + 1], 4) for first in (1, 5, 9)]
    streams = [host.submit(request) for request in requests]
    take_head = host._state.take_head

    def take_then_cancel(jobs):
        taken = take_head(jobs)
        if any(job.request is requests[1] for job in taken):
            streams[1].cancel()  # after the take, before its lane opens
        return taken

    host._state.take_head = take_then_cancel
    replies = run_all(host, streams)
    assert replies[1].reason == CANCELLED and replies[1].token_ids == ()
    assert backend.num_opens == 2, "the cancelled job got no lane"
    assert [replies[0], replies[2]] == [backend.solo_reply(requests[0]), backend.solo_reply(requests[2])]
    backend.assert_clean()


def test_a_long_prompts_chunks_ride_with_the_decode_rounds():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=8)
    host = make_host(backend)
    live = host.submit(request_of(1, 3, 30))
    host.step()
    long = request_of(9, 40, 4)  # five chunks of 8
    streams = [live, host.submit(long)]
    replies = run_all(host, streams)
    # Every chunk went in a decode round's pass: a prefill right after each decode, never alone.
    after_start = backend.timeline[backend.timeline.index(("decode", 1)) :]
    chunks = [i for i, (kind, size) in enumerate(after_start) if kind == "prefill"]
    assert len(chunks) == 5 and all(after_start[i - 1][0] == "decode" for i in chunks)
    assert replies == [backend.solo_reply(request_of(1, 3, 30)), backend.solo_reply(long)]
    backend.assert_clean()


def passes_beside_decoders(num_decoders: int, num_tokens: int, prompt_len: int, step_tokens: int):
    """num_decoders streams decoding num_tokens each, then a prompt of prompt_len tokens (passes of
    at most 64) arriving a step later, under step_tokens: every reply equals its solo run; the
    backend's timeline of passes."""
    backend = FakeBackend(num_lanes=num_decoders + 1, max_prefill_tokens=64, context_size=256, room=1024)
    host = make_host(backend, step_tokens=step_tokens)
    decoders = [request_of(3 * i, 3, num_tokens) for i in range(num_decoders)]
    streams = [host.submit(request) for request in decoders]
    host.step()
    long = request_of(9, prompt_len, 4)
    streams.append(host.submit(long))
    replies = run_all(host, streams)
    assert replies == [backend.solo_reply(request) for request in (*decoders, long)]
    backend.assert_clean()
    return backend.timeline


def test_a_chunk_beside_a_round_takes_what_the_step_token_budget_leaves():
    # step_tokens 20: beside 3 decoding streams a chunk is 17 tokens, not the 64 a pass may take, so
    # the decoders' rounds stay about their own size; alone (nothing decoding) it goes 64 at a time.
    timeline = passes_beside_decoders(3, 40, 100, step_tokens=20)
    after = timeline[timeline.index(("decode", 3)) :]
    beside = [
        size for before, (kind, size) in zip(after, after[1:]) if kind == "prefill" and before[0] == "decode"
    ]
    assert beside[:5] == [17] * 5 and sum(beside) == 100


def test_a_chunk_beside_a_full_round_still_moves_on():
    # A budget the decode rows already fill: the chunk still gets one row tile (16) a round. The
    # prompt is longer than one pass: it goes in chunks.
    timeline = passes_beside_decoders(2, 60, 72, step_tokens=2)
    sizes = [size for kind, size in timeline if kind == "prefill" and size != 3]
    assert sizes == [16, 16, 16, 16, 8]


def test_a_refused_chunk_beside_a_round_fails_its_request_alone():
    backend = FakeBackend(num_lanes=2, max_prefill_tokens=8)
    backend.poisoned_prompts = {37}
    host = make_host(backend)
    live = request_of(1, 3, 30)
    streams = [host.submit(live)]
    host.step()
    streams.append(host.submit(request_of(36, 40, 4)))  # its first token is 37: refused
    replies = run_all(host, streams)
    assert replies[1].reason == "error" and "prefill failed" in replies[1].error
    assert replies[0] == backend.solo_reply(live)
    assert not host.broken
    backend.assert_clean()

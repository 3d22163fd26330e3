"""Random schedules of submits, cancels and steps on random fake shapes, room often far below what
the lanes could hold (memory-bound, as on a GPU pair): nothing wedges, every stream ends, no request
that could ever fit fails (it waits, or is preempted and recomputed), every whole reply equals its
solo run, and every lane and every KV block come back."""

from __future__ import annotations

from fake_backend import FakeBackend
from fake_replies import make_request, read_reply
from fake_tokens import EOS_IDS, fake_detokenize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpserve.server.lane_host import LaneHost
from tpserve.server.requests import QueueFull

POISONED = 29  # prompts starting with this token fail their prefill

shapes = st.fixed_dictionaries(
    {
        "num_lanes": st.integers(1, 4),
        "room": st.integers(40, 160),
        "block_size": st.sampled_from([1, 3, 4, 8, 16]),
        "context_size": st.just(64),
        "max_prefill_tokens": st.integers(3, 16),
        "batched": st.booleans(),
        "max_batch_streams": st.integers(2, 4),
    }
)

requests = st.builds(
    lambda prompt, max_tokens, seed, stop, background, ignore_eos: make_request(
        prompt, max_tokens, seed=seed, stop=stop, background=background, ignore_eos=ignore_eos
    ),
    prompt=st.lists(st.integers(1, 39), min_size=1, max_size=20),
    max_tokens=st.integers(1, 24),
    seed=st.none() | st.integers(0, 5),
    stop=st.sampled_from([(), ("a",), ("ko", "mu")]),
    background=st.booleans(),
    ignore_eos=st.booleans(),
)

actions = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), requests),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, schedule=actions, queue_size=st.integers(1, 8), prefix_caching=st.booleans())
def test_random_schedules_never_wedge_and_replies_equal_solo(shape, schedule, queue_size, prefix_caching):
    backend = FakeBackend(**shape)
    backend.poisoned_prompts = {POISONED}
    host = LaneHost(
        backend,
        detokenize=fake_detokenize,
        eos_ids=EOS_IDS,
        queue_size=queue_size,
        prefix_caching=prefix_caching,
    )
    submitted = []
    for kind, value in schedule:
        if kind == "submit":
            try:
                submitted.append((value, host.submit(value)))
            except QueueFull:
                assert host.stats().queued >= queue_size
        elif kind == "cancel" and submitted:
            submitted[value % len(submitted)][1].cancel()
        elif kind == "step":
            for _ in range(value):
                host.step()
    for _ in range(5000):
        if all(stream.finished is not None for _, stream in submitted):
            break
        host.step()
    assert not host.step(), "the host has nothing left to do"
    assert not host.broken
    backend.assert_clean()
    for request, stream in submitted:
        reply = read_reply(stream)
        solo = backend.solo_reply(request)
        if reply.reason == "cancelled":
            assert reply.token_ids == solo.token_ids[: len(reply.token_ids)]
            assert solo.text.startswith(reply.text)
        elif reply.reason == "error":
            # Only a poisoned prompt fails, or one that could never fit in the whole pool.
            assert request.prompt_ids[0] == POISONED or "the request needs" in reply.error, reply.error
        else:
            assert reply == solo

"""A step is one pass (issue 29: one message per step, nothing extra per admitted request): on the
fake backend, every host.step() that nothing refuses calls the backend for at most one forward
pass. Prompts taken while nothing decodes go in a pass of their own, and that pass is their step's;
the streams it starts decode from the next step on, with the prompts taken then riding beside them.
Only a refusal (a joint pass or a prompt beside the round that the engine refuses, a prompt that
fails) costs passes of its own, each prompt then alone. Replies stay their solo runs."""

from __future__ import annotations

import contextlib

from fake_backend import FakeBackend, FakeFailure
from fake_replies import make_request, read_reply
from fake_tokens import EOS_IDS, fake_detokenize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_lane_host_random import POISONED, actions, shapes

from tpserve.server.backend import ChunkRefused
from tpserve.server.lane_host import LaneHost
from tpserve.server.requests import QueueFull


class CountingFake(FakeBackend):
    """A fake that counts its forward passes (prefill, prefill_many, decode, decode_drafts) and the
    ones refused or failed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_passes = 0
        self.num_refusals = 0

    def _counted(self, operation, *args):
        self.num_passes += 1
        try:
            result = operation(*args)
        except (FakeFailure, ChunkRefused):
            self.num_refusals += 1
            raise
        if result is None and operation.__name__ == "prefill_many":
            self.num_refusals += 1
        return result

    def prefill(self, item):
        return self._counted(super().prefill, item)

    def prefill_many(self, items):
        return self._counted(super().prefill_many, items)

    def decode(self, items, prompts=()):
        return self._counted(super().decode, items, prompts)

    def decode_drafts(self, items, prompts=()):
        return self._counted(super().decode_drafts, items, prompts)


def step_counting(host: LaneHost, backend: CountingFake) -> int:
    """One step; the passes it ran. At most one unless something in it was refused."""
    num_passes, num_refusals = backend.num_passes, backend.num_refusals
    host.step()
    ran = backend.num_passes - num_passes
    assert ran <= 1 or backend.num_refusals > num_refusals, f"a step ran {ran} passes"
    return ran


def make_host(backend, **kwargs):
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, **kwargs)


def test_a_burst_then_prompts_while_decoding_then_a_long_prompt_one_pass_a_step():
    """A joint pass of four prompts while nothing decodes is its step's one pass (no decode round
    after it in that step); prompts taken while they decode ride in the round; a long prompt's
    chunks ride too; drafts change nothing of it. Every reply equals its solo run."""
    backend = CountingFake(batched=True, num_lanes=8, max_prefill_tokens=16, repeat_period=4)
    host = make_host(backend, prefix_caching=True, max_draft_tokens=3)
    burst = [
        make_request([k, k + 2, k + 1], 12, ignore_eos=True, seed=k if k % 2 else None) for k in (1, 5, 9, 13)
    ]
    streams = [host.submit(request) for request in burst]
    assert step_counting(host, backend) == 1
    assert backend.joint_passes == [4] and backend.num_decodes + backend.num_verifies == 0
    later = [
        make_request(list(range(20, 60)), 6, ignore_eos=True),  # 40 tokens: three chunks
        make_request([3, 4], 8, ignore_eos=True),
        make_request([7, 7, 7], 8, ignore_eos=True, seed=3),
    ]
    streams += [host.submit(request) for request in later]
    steps = 0
    while not all(stream.finished is not None for stream in streams):
        assert step_counting(host, backend) == 1, "a step with live streams ran no pass"
        steps += 1
        assert steps < 200
    assert backend.joint_passes == [4] and backend.num_prefills == 5, "3 chunks and 2 prompts rode"
    assert backend.num_refusals == 0 and backend.num_verifies > 0
    assert [read_reply(stream) for stream in streams] == [backend.solo_reply(r) for r in burst + later]
    backend.assert_clean()


def test_a_backend_that_runs_one_prompt_a_pass_still_makes_one_pass_a_step():
    """Without joint passes the first prompt goes alone, then each next one rides in a round."""
    backend = CountingFake(num_lanes=4)
    host = make_host(backend)
    requests = [make_request([k, 2, 3], 6, ignore_eos=True) for k in (1, 4, 7)]
    streams = [host.submit(request) for request in requests]
    while not all(stream.finished is not None for stream in streams):
        assert step_counting(host, backend) == 1
    assert backend.beside_round == [1, 1]
    assert [read_reply(stream) for stream in streams] == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, schedule=actions, queue_size=st.integers(1, 8), prefix_caching=st.booleans())
def test_random_schedules_run_at_most_one_pass_a_step_unless_refused(
    shape, schedule, queue_size, prefix_caching
):
    backend = CountingFake(**shape)
    backend.poisoned_prompts = {POISONED}
    host = make_host(backend, queue_size=queue_size, prefix_caching=prefix_caching)
    submitted = []
    for kind, value in schedule:
        if kind == "submit":
            with contextlib.suppress(QueueFull):
                submitted.append((value, host.submit(value)))
        elif kind == "cancel" and submitted:
            submitted[value % len(submitted)][1].cancel()
        elif kind == "step":
            for _ in range(value):
                step_counting(host, backend)
    for _ in range(5000):
        if all(stream.finished is not None for _, stream in submitted):
            break
        step_counting(host, backend)
    backend.assert_clean()
    for request, stream in submitted:
        reply = read_reply(stream)
        if reply.reason not in ("cancelled", "error"):
            assert reply == backend.solo_reply(request)

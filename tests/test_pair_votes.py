"""Control traffic on the real two-rank engine: a step is one message with at most one vote (prompts
alone while nothing decodes, or riding in the round), and only a pass that starts a prompt is voted
on, so a long prompt's later chunks riding beside the decode round cost no vote (issue 29: nothing
extra per admitted request)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from test_engine_pair import (
    GREEDY,
    REQUESTS,
    pair_settings,
    read_reply,
    read_until_token,
    request,
    run_alone,
    submit_together,
)
from tiny_models import write_tiny_model

from tpserve.ranks.wire_messages import Idle, Release, StepPlan
from tpserve.server.wiring import local_engine


@dataclass
class Sent:
    msg: object  # the message rank 0 sent (a StepPlan, or Idle or Stop between steps)
    votes: int = 0  # votes rank 0 took before its next message


class WatchedChannel:
    """Rank 0's channel, noting each message it sends and the votes taken after it."""

    def __init__(self, channel):
        self._channel = channel
        self.sent: list[Sent] = []

    def send(self, msg) -> None:
        self.sent.append(Sent(msg))
        self._channel.send(msg)

    def vote(self, ok: bool) -> bool:
        self.sent[-1].votes += 1
        return self._channel.vote(ok)

    def __getattr__(self, name):
        return getattr(self._channel, name)


def prompt_starts(msg) -> list[int]:
    """Where each prompt span of a step's pass starts ([] for a pass with no prompt)."""
    prefill = msg.prefill if isinstance(msg, StepPlan) else None
    return [span.start for span in prefill.spans] if prefill is not None else []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("votes") / "llama", "llama"))


def test_a_long_prompts_later_chunks_beside_the_round_cost_no_vote(model_dir):
    decoding = request(range(150, 170), 40, GREEDY)
    long = request([i * 11 % 290 + 3 for i in range(150)], 8, GREEDY)  # over max_prefill_tokens 48
    batch = [decoding, long, REQUESTS[1], REQUESTS[2]]
    # A small pass budget: the long prompt goes in several chunks beside the decode round.
    with local_engine(pair_settings(model_dir, step_tokens=32)) as engine:
        alone = run_alone(engine.host, batch)
        watched = WatchedChannel(engine.leader.channel)
        engine.leader.channel = watched
        early = submit_together(engine.host, batch[:1])
        events = read_until_token(early[0])
        late = submit_together(engine.host, batch[1:])
        replies = [read_reply(early[0], events)] + [read_reply(stream) for stream in late]
        engine.leader.channel = watched._channel
    assert replies == alone
    passes = [sent for sent in watched.sent if prompt_starts(sent.msg)]
    later_chunks = [sent for sent in passes if min(prompt_starts(sent.msg)) > 0]  # no prefix cache
    print(
        f"{len(watched.sent)} messages, {sum(s.votes for s in watched.sent)} votes; "
        f"{len(later_chunks)} later chunks beside the round"
    )
    assert len(later_chunks) >= 2 and all(sent.msg.round is not None for sent in later_chunks)
    # A pass that starts a prompt is voted on once (so a refusal still rolls back); nothing else is.
    assert [sent.votes for sent in watched.sent] == [
        int(sent in passes and min(prompt_starts(sent.msg)) == 0) for sent in watched.sent
    ]


class StepMarks:
    """The lane host's on_step: where each scheduling step's messages end, once a channel is watched."""

    def __init__(self):
        self.watched: WatchedChannel | None = None
        self.ends: list[int] = []  # len(watched.sent) after each step

    def __call__(self) -> None:
        if self.watched is not None:
            self.ends.append(len(self.watched.sent))

    def steps(self, sent: list[Sent]) -> list[list[Sent]]:
        """The messages of each step that sent a pass, those between steps (Idle, and Stop with the
        lanes closed just before it, a StepPlan with no pass) left out."""
        bounds = [0, *self.ends, len(sent)]
        groups = [[s for s in sent[a:b] if runs_pass(s.msg)] for a, b in zip(bounds, bounds[1:])]
        return [group for group in groups if group]


def runs_pass(msg) -> bool:
    return isinstance(msg, StepPlan) and msg.runs_pass


def test_a_step_is_one_message_when_prompts_go_alone_and_when_they_ride(model_dir):
    """Prompts taken while nothing decodes go in one joint prompt pass, their step's only message
    (the streams it starts decode from the next step on); prompts taken while those decode, and a
    long prompt's chunks, ride in the round's pass: each step is one StepPlan. No step sends a second message, so an
    admitted request costs no message of its own; every reply equals its solo run."""
    long = request([i * 7 % 290 + 3 for i in range(120)], 6, GREEDY)  # over max_prefill_tokens 48
    burst = [REQUESTS[0], REQUESTS[1], REQUESTS[2]]
    late = [long, REQUESTS[3], request(range(40, 52), 10, GREEDY)]
    marks = StepMarks()
    with local_engine(pair_settings(model_dir, step_tokens=32), on_step=marks) as engine:
        alone = run_alone(engine.host, burst + late)
        watched = WatchedChannel(engine.leader.channel)
        engine.leader.channel = watched
        marks.watched = watched
        early = submit_together(engine.host, burst)
        events = read_until_token(early[0])
        streams = submit_together(engine.host, late)
        replies = [read_reply(early[0], events)] + [read_reply(s) for s in early[1:] + streams]
        marks.watched = None
        engine.leader.channel = watched._channel
    assert replies == alone
    steps = marks.steps(watched.sent)
    print(f"{sum(len(step) for step in steps)} messages in {len(steps)} steps")
    assert all(len(step) == 1 for step in steps), [[s.msg for s in step] for step in steps]
    passes = [step[0].msg for step in steps]
    first = passes[0]
    assert first.round is None and len(first.prefill.spans) == 3, "the burst's joint pass, alone"
    assert passes[1].round is not None, "its streams decode in the next step"
    riding = [msg for msg in passes if msg.round is not None and 0 in prompt_starts(msg)]
    assert riding and all(sum(s.votes for s in step) <= 1 for step in steps)


def wait_for_idle(watched: WatchedChannel, timeout_s: float = 30.0) -> None:
    """Until rank 0's last message is Idle: the scheduler ran out of work and told the followers."""
    deadline = time.monotonic() + timeout_s
    while not (watched.sent and isinstance(watched.sent[-1].msg, Idle)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 sent no Idle within {timeout_s}s")
        time.sleep(0.01)


def test_an_idle_spell_costs_one_message_and_the_lanes_closed_before_it_go_with_the_next_pass(model_dir):
    """A request served alone, then an idle spell, then the next: rank 0 sends Idle and nothing
    else between them (the first lane's Release waits for the second's first pass, in its StepPlan),
    so a request costs only its steps' messages; the replies equal their solo runs."""
    requests = [REQUESTS[0], REQUESTS[1]]
    with local_engine(pair_settings(model_dir)) as engine:
        alone = run_alone(engine.host, requests)
        watched = WatchedChannel(engine.leader.channel)
        engine.leader.channel = watched
        replies = []
        for each in requests:
            replies.append(read_reply(engine.host.submit(each)))
            wait_for_idle(watched)
        engine.leader.channel = watched._channel
    assert replies == alone
    sent = watched.sent
    if isinstance(sent[0].msg, Idle):  # the idle spell after the solo runs, if it began once watched
        sent = sent[1:]
    assert all(runs_pass(s.msg) or isinstance(s.msg, Idle) for s in sent), "no message of its own"
    idles = [i for i, s in enumerate(sent) if isinstance(s.msg, Idle)]
    assert len(idles) == 2 and idles[1] == len(sent) - 1
    after = sent[idles[0] + 1]  # the second request's first pass
    assert after.msg.round is None and after.msg.prefill is not None
    assert any(isinstance(change, Release) for change in after.msg.lanes)

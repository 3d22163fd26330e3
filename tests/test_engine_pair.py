"""The real engine on two ranks, driven through the lane host (no gRPC): rank 0 here, the follower a
child process (`local_engine`). Tiny model; the default model's run is test_engine_pair_default.py.

The oracle is each request's solo run: a request submitted alone to an idle engine. Sampling is
position-keyed and every product is batch-invariant, so a reply must equal its solo run token for
token whatever ran beside it, whichever lane it got, and whether its prompt was prefilled alone, in
chunks or in one joint pass with others.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from tiny_models import write_tiny_model

from tpserve.kernels.attention_kernels import choose_attention, kv_dtype
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import ChunkRefused
from tpserve.ranks.kv_store import kv_bytes_per_token
from tpserve.ranks.settings import EngineSettings
from tpserve.server.lane_host import LaneHost
from tpserve.server.lane_stream import Stream
from tpserve.server.requests import ERROR, Event, Finished, GenerationRequest, HostUnavailable, TokenDelta
from tpserve.server.wiring import local_engine

EVENT_TIMEOUT_S = 30.0
# The tiny llama's rank 0: 2 layers x (K, V) x 2 KV heads x 16 values, in the pool's dtype as kv_dtype
# auto picks it (float16 where the C attention kernel serves, else float32).
_POOL_DTYPE = kv_dtype("auto", choose_attention(True, 16, 2, torch.float32, "cpu"), torch.float32)
RANK0_BYTES_PER_TOKEN = kv_bytes_per_token(2, [2], 16, _POOL_DTYPE)
ROOM = 1504  # whole KV blocks of 32
POISON = 300  # the follower refuses any prompt holding this token (EngineSettings.refuse_token_on_rank)
GREEDY = SamplingParams()


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed)


def request(prompt, max_tokens: int, sampling: SamplingParams, ignore_eos: bool = True) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), max_tokens, sampling, ignore_eos=ignore_eos)


# Different prompt and reply lengths, greedy and sampled; none holds POISON. The long prompt goes last
# so that the seven before it can share one prompt pass (a prompt that needs chunks goes alone).
REQUESTS = (
    request(range(3, 10), 24, GREEDY),
    request((42,), 5, sampled(1)),
    request(range(20, 53), 17, GREEDY),
    request(range(20, 53), 17, sampled(2)),  # the same prompt sampled: it must leave the greedy path
    request([i * 7 % 290 + 3 for i in range(25)], 40, sampled(3)),
    request((5, 6, 5, 6, 5, 6, 9), 9, GREEDY, ignore_eos=False),
    request(range(100, 112), 31, sampled(4), ignore_eos=False),
    request(range(60, 150), 12, GREEDY),  # 90 tokens, over max_prefill_tokens: prefilled in chunks
)


@dataclass(frozen=True)
class Reply:
    token_ids: tuple[int, ...]
    reason: str
    completion_tokens: int
    error: str | None


def pair_settings(model_dir: str, **changes) -> EngineSettings:
    settings = EngineSettings(
        model_dir=model_dir,
        device="cpu",  # the CPU, also on a GPU host (tests/conftest.py: gpu tests are marked)
        num_lanes=8,
        context_size=256,
        max_prefill_tokens=48,
        # Equal budgets: rank 0 holds 2 of the 3 KV heads, so its figure (budget / 512) is the room.
        kv_budget_bytes=(RANK0_BYTES_PER_TOKEN * ROOM, RANK0_BYTES_PER_TOKEN * ROOM),
        threads_per_rank=1,
        init_timeout_s=30.0,
        collective_timeout_s=30.0,
        refuse_token_on_rank=(1, POISON),
        # Each reply (and record file) is compared with its solo run: no prompt cache serves a
        # second run from the first (tests/test_cache_pair.py has one). Drafts: the daemon's default.
        prefix_caching=False,
    )
    return replace(settings, **changes)


# ---- driving the host -------------------------------------------------------------------------


def read_reply(stream: Stream, events: Sequence[Event] = ()) -> Reply:
    """The whole reply: the given already-read events, then the stream's up to Finished."""
    tokens: list[int] = []
    for event in [*events, *stream.events(timeout_each=EVENT_TIMEOUT_S)]:
        if isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            return Reply(tuple(tokens), event.reason, event.usage.completion_tokens, event.error)
    raise AssertionError("the stream ended without Finished")


def read_until_token(stream: Stream) -> list[Event]:
    """Events up to the first token (or Finished), so the stream is known to be decoding."""
    events: list[Event] = []
    while not events or not isinstance(events[-1], (TokenDelta, Finished)):
        event = stream.next_event(EVENT_TIMEOUT_S)
        if event is None:
            raise TimeoutError(f"no event within {EVENT_TIMEOUT_S}s")
        events.append(event)
    return events


def submit_together(host: LaneHost, requests: Sequence[GenerationRequest]) -> list[Stream]:
    """Queue every request before the scheduler thread looks at the queue, so they wait together.

    A long GIL switch interval keeps this thread running until it blocks; submit never blocks.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        return [host.submit(r) for r in requests]
    finally:
        sys.setswitchinterval(interval)


def run_together(host: LaneHost, requests: Sequence[GenerationRequest]) -> list[Reply]:
    return [read_reply(stream) for stream in submit_together(host, requests)]


def run_alone(host: LaneHost, requests: Sequence[GenerationRequest]) -> list[Reply]:
    return [read_reply(host.submit(r)) for r in requests]


@dataclass
class JointPass:
    prompts: list[tuple[int, ...]]
    accepted: bool


@dataclass
class JointPasses:
    passes: list[JointPass] = field(default_factory=list)

    @property
    def accepted(self) -> list[int]:
        return [len(p.prompts) for p in self.passes if p.accepted]


@contextmanager
def watch_joint_passes(leader) -> Iterator[JointPasses]:
    """Notes every prefill_many over two or more prompts the host makes (the real call runs)."""
    seen = JointPasses()
    inner = leader.prefill_many

    def watched(items):
        tokens = inner(items)
        if len(items) >= 2:
            seen.passes.append(JointPass([tuple(i.token_ids) for i in items], tokens is not None))
        return tokens

    leader.prefill_many = watched  # the host and leader.prefill both look it up on the instance
    try:
        yield seen
    finally:
        del leader.prefill_many


@contextmanager
def watch_prompts_beside_rounds(leader) -> Iterator[JointPasses]:
    """Notes every decode round that carries prompts (the real call runs), accepted or refused."""
    seen = JointPasses()
    inner = {name: getattr(leader, name) for name in ("decode", "decode_drafts")}

    def watching(name):
        def watched(items, prompts=()):
            try:
                out = inner[name](items, prompts)
            except ChunkRefused:
                seen.passes.append(JointPass([tuple(p.token_ids) for p in prompts], False))
                raise
            if prompts:
                seen.passes.append(JointPass([tuple(p.token_ids) for p in prompts], True))
            return out

        return watched

    for name in inner:
        setattr(leader, name, watching(name))
    try:
        yield seen
    finally:
        for name in inner:
            delattr(leader, name)


@contextmanager
def watch_opens(leader) -> Iterator[list[int]]:
    """Notes every lane the host opens: how many lanes are open right after it (the real call runs)."""
    lanes_open: list[int] = []
    inner = leader.open

    def watched(lane: int, blocks: tuple[int, ...], num_cached: int, copy_from: int = -1) -> None:
        inner(lane, blocks, num_cached, copy_from)
        lanes_open.append(len(leader.engine.lanes))

    leader.open = watched
    try:
        yield lanes_open
    finally:
        del leader.open


def assert_nothing_held(host: LaneHost) -> None:
    stats = host.stats()
    assert (stats.queued, stats.lanes_busy, stats.room_used) == (0, 0, 0), stats


def follower_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), all threads
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("pair") / "llama", "llama"))


@pytest.fixture(scope="module")
def solo(model_dir) -> dict[GenerationRequest, Reply]:
    """Each request of REQUESTS run alone on a fresh float32 pair, plain decoding: the oracle."""
    with local_engine(pair_settings(model_dir, draft_tokens=0)) as engine:
        return dict(zip(REQUESTS, run_alone(engine.host, REQUESTS)))


def test_solo_replies_are_real(solo):
    # The oracle itself: replies of the lengths asked for, and sampling really leaves the greedy path.
    for req, reply in solo.items():
        assert reply.reason in ("stop", "length") and reply.error is None
        if req.ignore_eos:
            assert reply.reason == "length" and len(reply.token_ids) == req.max_tokens
    assert solo[REQUESTS[2]].token_ids != solo[REQUESTS[3]].token_ids


class TestSharedPair:
    """One float32 pair for these tests (starting one costs seconds)."""

    @pytest.fixture(scope="class")
    @classmethod
    def pair(cls, model_dir, solo):
        with local_engine(pair_settings(model_dir)) as engine:
            yield engine

    def test_room_is_rank_0s_figure(self, pair):
        # Equal budgets, uneven 2+1 KV split: rank 0 holds twice the bytes per token, so less room.
        assert pair.runtime.kv_budget.kv_bytes_per_token == RANK0_BYTES_PER_TOKEN
        assert pair.leader.room == ROOM
        assert pair.host.stats().room == ROOM

    def test_streams_joining_mid_decode_equal_their_solo_runs(self, pair, solo):
        first, second = REQUESTS[:4], REQUESTS[4:]
        early = submit_together(pair.host, first)
        early_events = [read_until_token(stream) for stream in early]
        # The first four are decoding; the rest join between their rounds.
        late = submit_together(pair.host, second)
        replies = [read_reply(s, e) for s, e in zip(early, early_events)] + [read_reply(s) for s in late]
        assert replies == [solo[r] for r in REQUESTS]
        assert_nothing_held(pair.host)

    def test_joint_prompt_pass_equals_solo_runs(self, pair, solo):
        with watch_joint_passes(pair.leader) as joint:
            replies = run_together(pair.host, REQUESTS)
        print(f"joint prompt passes (prompts in each): {joint.accepted}")
        # The seven short prompts waited together, so at least two of them shared one pass.
        assert joint.accepted and max(joint.accepted) >= 2
        assert replies == [solo[r] for r in REQUESTS]
        assert_nothing_held(pair.host)

    def test_a_refused_joint_pass_rolls_back_on_every_rank(self, pair, solo):
        poisoned = request((7, 8, POISON, 9), 6, GREEDY)
        batch = [REQUESTS[0], poisoned, REQUESTS[1], REQUESTS[2]]
        with watch_joint_passes(pair.leader) as joint:
            replies = run_together(pair.host, batch)
        # The follower refused the pass holding the poisoned prompt; rank 0 went along with the vote.
        refused = [p for p in joint.passes if not p.accepted]
        assert refused and poisoned.prompt_ids in refused[0].prompts and len(refused[0].prompts) == 4
        # The host ran each alone: none was left prefilled (a solo prefill starts at position 0).
        assert replies[1].reason == ERROR and replies[1].token_ids == ()
        assert "refused" in replies[1].error
        assert [replies[i] for i in (0, 2, 3)] == [solo[r] for r in (REQUESTS[0], REQUESTS[1], REQUESTS[2])]
        assert_nothing_held(pair.host)
        # Both ranks still agree on every lane: a later joint pass works and is exact.
        with watch_joint_passes(pair.leader) as joint:
            again = run_together(pair.host, REQUESTS[:3])
        assert joint.accepted and all(p.accepted for p in joint.passes)
        assert again == [solo[r] for r in REQUESTS[:3]]
        assert_nothing_held(pair.host)

    def test_prompts_ride_in_a_decode_round_and_a_refused_one_fails_alone(self, pair, solo):
        long = request(range(150, 170), 120, GREEDY)  # decodes while the others arrive
        (long_alone,) = run_alone(pair.host, [long])
        poisoned = request((7, 8, POISON, 9), 6, GREEDY)
        with watch_prompts_beside_rounds(pair.leader) as beside:
            early = submit_together(pair.host, [long])
            events = [read_until_token(early[0])]
            # The three whole prompts go in the long stream's round, refused there (the follower
            # refuses POISON), then each alone.
            late = submit_together(pair.host, [REQUESTS[1], poisoned, REQUESTS[2]])
            replies = [read_reply(early[0], events[0])] + [read_reply(stream) for stream in late]
        refused = [p for p in beside.passes if not p.accepted]
        assert refused and poisoned.prompt_ids in refused[0].prompts and len(refused[0].prompts) == 3
        assert replies[2].reason == ERROR and replies[2].token_ids == () and "refused" in replies[2].error
        assert [replies[i] for i in (0, 1, 3)] == [long_alone, solo[REQUESTS[1]], solo[REQUESTS[2]]]
        assert_nothing_held(pair.host)
        # Both ranks still agree on every lane: two prompts ride in one round and are exact.
        with watch_prompts_beside_rounds(pair.leader) as beside:
            early = submit_together(pair.host, [long])
            events = [read_until_token(early[0])]
            late = submit_together(pair.host, [REQUESTS[1], REQUESTS[5]])
            again = [read_reply(early[0], events[0])] + [read_reply(stream) for stream in late]
        assert beside.accepted and max(beside.accepted) == 2, "both rode in one decode round"
        assert again == [long_alone, solo[REQUESTS[1]], solo[REQUESTS[5]]]
        assert_nothing_held(pair.host)

    def test_cancelled_streams_leave_the_others_exact(self, pair, solo):
        doomed = [request(range(150, 170), 200, GREEDY), request(range(170, 180), 200, sampled(9))]
        batch = [*REQUESTS[:3], doomed[0], *REQUESTS[3:6], doomed[1]]
        streams = submit_together(pair.host, batch)
        events = [read_until_token(stream) for stream in streams]
        streams[3].cancel()
        streams[7].cancel()
        replies = [read_reply(s, e) for s, e in zip(streams, events)]
        for cancelled in (replies[3], replies[7]):
            assert cancelled.reason == "cancelled" and 0 < len(cancelled.token_ids) < 200
        kept = [r for i, r in enumerate(replies) if i not in (3, 7)]
        assert kept == [solo[r] for r in REQUESTS[:6]]
        assert_nothing_held(pair.host)

    def test_an_idle_follower_does_not_spin(self, pair):
        run_together(pair.host, REQUESTS[:2])
        time.sleep(1.0)  # the host goes idle and tells the follower so
        pid = pair.followers[0].pid
        started, before = time.monotonic(), follower_cpu_seconds(pid)
        time.sleep(3.0)
        share = (follower_cpu_seconds(pid) - before) / (time.monotonic() - started)
        print(f"idle follower: {100 * share:.2f}% of a core")
        assert share < 0.05
        # And it wakes up when work comes.
        assert run_alone(pair.host, REQUESTS[1:2])[0].reason == "length"


class TestSmallPair:
    """Two lanes and room for 200 tokens: requests wait for room, background streams yield lanes."""

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls, model_dir):
        budget = RANK0_BYTES_PER_TOKEN * 200
        # No refusal drill: a preempted stream re-prefills the tokens it produced, POISON among them.
        settings = pair_settings(
            model_dir, num_lanes=2, kv_budget_bytes=(budget, budget), refuse_token_on_rank=()
        )
        with local_engine(settings) as engine:
            yield engine

    def test_streams_that_outgrow_the_room_are_preempted_and_run_exactly(self, small):
        # 120 tokens each: two lanes are free but the room (rank 0's 200) holds one whole stream at a
        # time. Both start; when their blocks run out the newer is preempted, and recomputed later.
        batch = [request(range(20 + i, 40 + i), 100, sampled(i) if i else GREEDY) for i in range(3)]
        alone = run_alone(small.host, batch)
        preempted = small.host.stats().preempted
        with watch_opens(small.leader) as lanes_open:
            together = run_together(small.host, batch)
        assert max(lanes_open) == 2, "two streams ran at once"
        assert small.host.stats().preempted > preempted
        assert together == alone
        assert_nothing_held(small.host)

    def test_background_streams_yield_and_resume_exactly(self, small):
        background = [
            replace(request(range(40, 55), 70, GREEDY), background=True),
            replace(request(range(55, 70), 70, sampled(5)), background=True),
        ]
        foreground = [request(range(200, 210), 20, GREEDY), request(range(210, 215), 20, sampled(6))]
        alone = run_alone(small.host, background + foreground)
        with watch_opens(small.leader) as lanes_open:
            streams = submit_together(small.host, background)
            events = [read_until_token(stream) for stream in streams]
            # Both lanes are busy with background streams: each yields to a foreground request,
            # then resumes by prefilling its prompt and what it already produced.
            late = submit_together(small.host, foreground)
            replies = [read_reply(s, e) for s, e in zip(streams, events)] + [read_reply(s) for s in late]
        assert len(lanes_open) >= 6  # two background, two foreground, two resumed (and any preempted)
        assert replies == alone
        assert_nothing_held(small.host)


def test_bfloat16_replies_equal_their_solo_runs(model_dir):
    with local_engine(pair_settings(model_dir, dtype="bfloat16")) as engine:
        alone = run_alone(engine.host, REQUESTS)
        together = run_together(engine.host, REQUESTS)
    assert engine.followers[0].exitcode == 0  # Stop reached it: a clean exit
    num_differing = sum(a != b for a, b in zip(alone, together))
    print(f"bfloat16, tiny model: {num_differing} of {len(REQUESTS)} replies differ from their solo runs")
    # Batch-invariant products: the same row gives the same bits in any batch, in bfloat16 too.
    assert num_differing == 0


def test_recorded_run_equals_unrecorded_and_solo_files(model_dir, solo, tmp_path):
    record_dir = tmp_path / "record"
    with local_engine(pair_settings(model_dir), record_dir=str(record_dir)) as engine:
        alone = run_alone(engine.host, REQUESTS)  # stream files 1..8, in REQUESTS order
        with watch_joint_passes(engine.leader) as joint:
            together = run_together(engine.host, REQUESTS)  # stream files 9..16
    assert joint.accepted and max(joint.accepted) >= 2
    assert alone == together == [solo[r] for r in REQUESTS]  # recording changes no reply
    files = sorted(record_dir.glob("stream-*.jsonl"))
    assert len(files) == 2 * len(REQUESTS)
    # Lanes open in queue order, so the files of either run are numbered in REQUESTS order.
    for solo_file, joint_file in zip(files[: len(REQUESTS)], files[len(REQUESTS) :]):
        # Same tokens, positions and top logits as its own solo run, line for line.
        assert joint_file.read_text() == solo_file.read_text(), (solo_file.name, joint_file.name)


def open_files_under(folder: Path) -> list[str]:
    """This process's open files inside `folder` (rank 0 runs here, its recorder too)."""
    names = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(str(folder)):
                names.append(target)
    return names


def test_recording_keeps_draft_tokens_on_and_writes_what_plain_decoding_writes(model_dir, solo, tmp_path):
    # --record with drafts on: drafts are checked and kept, replies are plain decoding's, and each
    # stream's file holds the lines a run without drafts writes; every file is closed at its end.
    # Long greedy replies: the random tiny model falls into loops that prompt lookup guesses.
    requests = (*REQUESTS, request(range(3, 10), 200, GREEDY), request((7, 7, 7), 200, GREEDY))
    plain_dir, drafts_dir = tmp_path / "plain", tmp_path / "drafts"
    with local_engine(pair_settings(model_dir, draft_tokens=0), record_dir=str(plain_dir)) as engine:
        plain = run_alone(engine.host, requests)
    with local_engine(pair_settings(model_dir, draft_tokens=15), record_dir=str(drafts_dir)) as engine:
        alone = run_alone(engine.host, requests)
        together = run_together(engine.host, requests)
        drafter = engine.host.drafter
        assert drafter is not None and drafter.num_drafted > drafter.num_accepted > 0, vars(drafter)
        assert open_files_under(drafts_dir) == []  # every stream ended: its file is closed
    assert plain == alone == together
    assert plain[: len(REQUESTS)] == [solo[r] for r in REQUESTS]
    plain_files = sorted(plain_dir.glob("stream-*.jsonl"))
    draft_files = sorted(drafts_dir.glob("stream-*.jsonl"))
    assert len(draft_files) == 2 * len(requests)
    for plain_file, alone_file, joint_file in zip(plain_files, draft_files, draft_files[len(requests) :]):
        assert alone_file.read_text() == plain_file.read_text(), (plain_file.name, alone_file.name)
        assert joint_file.read_text() == plain_file.read_text(), (plain_file.name, joint_file.name)


def test_killing_the_follower_ends_every_stream_with_an_error(model_dir):
    requests = [request(range(10 + i, 20 + i), 220, sampled(i)) for i in range(4)]
    with local_engine(pair_settings(model_dir, num_lanes=4)) as engine:
        streams = submit_together(engine.host, requests)
        events = [read_until_token(stream) for stream in streams]
        assert not any(isinstance(e[-1], Finished) for e in events), "a stream ended before the kill"
        follower = engine.followers[0]
        killed_at = time.monotonic()
        os.kill(follower.pid, signal.SIGKILL)
        replies = [read_reply(s, e) for s, e in zip(streams, events)]
        ended_after = time.monotonic() - killed_at
        print(f"all {len(streams)} streams ended {ended_after:.2f}s after the follower was killed")
        assert all(reply.reason == ERROR and "engine broken" in reply.error for reply in replies), replies
        assert all(0 < len(reply.token_ids) < 220 for reply in replies)
        assert ended_after < 15.0
        assert engine.host.broken and engine.leader.broken is not None
        with pytest.raises(HostUnavailable, match="the engine is broken"):
            engine.host.submit(requests[0])
        follower.join(5)
        assert follower.exitcode == -signal.SIGKILL


def test_a_follower_killed_while_idle_fails_the_next_request_at_once(model_dir):
    with local_engine(pair_settings(model_dir, num_lanes=4)) as engine:
        run_alone(engine.host, REQUESTS[:1])
        time.sleep(1.0)  # idle: no collective is running, so nothing notices the death yet
        os.kill(engine.followers[0].pid, signal.SIGKILL)
        engine.followers[0].join(5)
        started = time.monotonic()
        reply = run_alone(engine.host, REQUESTS[:1])[0]
        assert reply.reason == ERROR and "engine broken" in reply.error
        assert time.monotonic() - started < 30.0  # a hang guard: below the 30 s collective timeout
        assert engine.host.broken


def test_a_hung_follower_ends_every_stream_at_the_collective_timeout(model_dir):
    requests = [request(range(10 + i, 20 + i), 220, sampled(i)) for i in range(4)]
    with local_engine(pair_settings(model_dir, num_lanes=4, collective_timeout_s=3.0)) as engine:
        follower = engine.followers[0]
        try:
            streams = submit_together(engine.host, requests)
            events = [read_until_token(stream) for stream in streams]
            stopped_at = time.monotonic()
            os.kill(follower.pid, signal.SIGSTOP)  # alive, connected, silent
            replies = [read_reply(s, e) for s, e in zip(streams, events)]
            ended_after = time.monotonic() - stopped_at
        finally:
            os.kill(follower.pid, signal.SIGKILL)
    print(f"all streams ended {ended_after:.2f}s after the follower hung (collective timeout 3s)")
    # The wait that timed out is the channel's or one inside the forward pass, whichever came first.
    assert all(reply.reason == ERROR and "engine broken" in reply.error for reply in replies), replies
    assert 2.5 < ended_after < 10.0


def test_draft_tokens_change_no_reply(model_dir):
    """Rounds that check prompt-lookup drafts (Verify, then a lane cut back to what was kept) give
    every reply plain decoding gives, alone and together, greedy and sampled."""
    repetitive = (
        request((5, 6, 7, 5, 6, 7, 5, 6), 30, GREEDY),
        request((5, 6, 7, 5, 6, 7, 5, 6), 30, sampled(7)),
        request((9, 10, 9, 10, 9), 20, GREEDY, ignore_eos=False),
    )
    batch = repetitive + REQUESTS[:3]
    with local_engine(pair_settings(model_dir, draft_tokens=0)) as plain:
        expected = run_alone(plain.host, batch)
    with local_engine(pair_settings(model_dir, draft_tokens=15)) as drafted:
        alone = run_alone(drafted.host, batch)
        together = run_together(drafted.host, batch)
        drafter = drafted.host.drafter
    print(f"drafts: {drafter.num_accepted} of {drafter.num_drafted} accepted")
    assert drafter.num_drafted > 0
    assert alone == expected
    assert together == expected

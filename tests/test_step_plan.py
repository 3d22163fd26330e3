"""A step is a plan (tpserve/server/step_plan.py): the scheduler's schedule() reads only, so the same state
gives the same plan and planning calls nothing on the engine; the pass that runs is the plan's, and
replies stay exactly their solo runs. On the fake backend, which models blocks."""

from __future__ import annotations

import dataclasses

from fake_backend import FakeBackend
from fake_replies import make_request, read_reply
from fake_tokens import EOS_IDS, fake_detokenize

from tpserve.server.admit_plan import Opening, Yielded
from tpserve.server.backend import BACKEND_NAMES
from tpserve.server.lane_host import LaneHost
from tpserve.server.step_plan import StepPlan


class LoggedFake(FakeBackend):
    """A fake that logs every Backend call it gets, and the items of each decode round."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[str] = []
        self.rounds: list[tuple[list, list]] = []  # (decode items, prompt items) per round
        self.prompt_passes: list[list] = []  # the items of each prefill and prefill_many


def _logging(name):
    def call(self, *args):
        self.calls.append(name)
        if name in ("decode", "decode_drafts"):
            self.rounds.append((list(args[0]), list(args[1]) if len(args) > 1 else []))
        if name in ("prefill", "prefill_many"):
            self.prompt_passes.append(list(args[0]) if name == "prefill_many" else [args[0]])
        return getattr(FakeBackend, name)(self, *args)

    return call


for _name in BACKEND_NAMES:
    if callable(getattr(FakeBackend, _name, None)):
        setattr(LoggedFake, _name, _logging(_name))


def plain(value) -> bool:
    """Whether `value` is plain data: ints, bools, None and tuples or frozen dataclasses of them."""
    if value is None or isinstance(value, (int, bool)):
        return True
    if isinstance(value, tuple):
        return all(plain(item) for item in value)
    if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
        return all(plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def snapshot(host: LaneHost):
    """Everything planning could change: the book, every lane's job, the drafter's reach."""
    lanes = host._lanes
    jobs = [
        (
            job.lane,
            tuple(job.blocks),
            job.num_blocks_sent,
            job.num_blocks_kept,
            tuple(job.produced),
            job.num_prefilled,
        )
        for job in lanes.jobs()
    ]
    drafter = host.drafter
    reach = [] if drafter is None else sorted((r.tokens, r.resting) for r in drafter._streams.values())
    return lanes.blocks.stats(), lanes.blocks.num_free, lanes.num_free, jobs, reach


def make_host(backend, **kwargs):
    return LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS, **kwargs)


def plan_twice(host, backend) -> StepPlan:
    """schedule() twice: equal plans of plain data, no engine call, nothing changed."""
    before, num_calls = snapshot(host), len(backend.calls)
    first = host._scheduler.schedule()
    second = host._scheduler.schedule()
    assert first == second
    assert plain(first), first
    assert backend.calls[num_calls:] == [], "planning called the engine"
    assert snapshot(host) == before, "planning changed the scheduler's state"
    return first


def run_checking_plans(host, backend, streams, max_steps: int = 200, until_finished: bool = True) -> set[str]:
    """Step until every stream finished (or `max_steps` steps, unless `until_finished`); before
    each step schedule() is checked pure (plan_twice), the step is checked to run that very plan,
    and its passes to be the plan's: admission runs none. What the plans held: "took" (jobs taken
    off the queue, lanes opened), "yielded" (a background stream's lane), "rows" with "drafts", a
    "chunk" or "riding" prompts beside them, "alone" (prompts, nothing decoding), "admitted" (whole
    prompts of jobs taken this step in such a plan)."""
    scheduler = host._scheduler
    schedule = scheduler.schedule
    used = []  # (the plan the step ran, the rounds and prompt passes before it)

    def logged_schedule(admit=True):
        used.append((schedule(admit=admit), len(backend.rounds), len(backend.prompt_passes)))
        return used[-1][0]

    seen = set()
    for _ in range(max_steps):
        if all(stream.finished is not None for stream in streams):
            return seen
        planned = plan_twice(host, backend)
        scheduler.schedule = logged_schedule
        used.clear()
        host.step()
        scheduler.schedule = schedule
        assert [plan for plan, *_ in used] == [planned], "the step ran the plan made before it, once"
        plan, num_rounds, num_passes = used[-1]
        seen |= {"took"} if any(isinstance(step, Opening) for step in plan.admitted) else set()
        seen |= {"yielded"} if any(isinstance(step, Yielded) for step in plan.admitted) else set()
        if not plan.rows:  # nothing decodes: the plan's prompts went in passes of their own
            passes = backend.prompt_passes[num_passes:]
            fed = {(p.lane, p.start, len(p.token_ids), p.last) for items in passes for p in items}
            # (a set: a refused joint pass goes again, each prompt alone)
            assert fed == {(p.lane, p.start, p.num_tokens, p.last) for p in plan.prompts}
            if plan.joint:  # those went together, in the first of these passes
                assert [p.lane for p in passes[0]] == list(plan.joint)
            seen |= {"alone"} if plan.prompts else set()
            seen |= {"admitted"} if any(p.start == 0 and p.last for p in plan.prompts) else set()
            seen |= {"joint"} if plan.joint else set()
            continue
        items, prompts = backend.rounds[num_rounds]
        assert [(i.lane, i.position, i.token_id, i.draft, i.blocks) for i in items] == [
            (r.lane, r.position, r.token_id, r.draft, r.blocks) for r in plan.rows
        ]
        assert [(p.lane, p.start, len(p.token_ids), p.last, p.blocks) for p in prompts] == [
            (p.lane, p.start, p.num_tokens, p.last, p.blocks) for p in plan.prompts
        ]
        seen |= {"rows"} | ({"chunk"} if any(not p.last for p in plan.prompts) else set())
        seen |= {"riding"} if any(p.last and p.start == 0 for p in plan.prompts) else set()
        seen |= {"drafts"} if any(r.draft for r in plan.rows) else set()
    if until_finished:
        raise AssertionError(f"streams still running after {max_steps} steps")
    return seen


def test_schedule_is_pure_and_the_pass_that_runs_is_its_plan():
    """A long prompt alone in chunks, then streams decoding with drafts, a long prompt in chunks
    beside them, a short prompt riding in the round: every step's plan is the same asked twice,
    costs no engine call, and is what the step's passes carry; every reply equals its solo run."""
    backend = LoggedFake(num_lanes=4, room=512, block_size=4, max_prefill_tokens=16, repeat_period=5)
    host = make_host(backend, prefix_caching=True, max_draft_tokens=4, step_tokens=24)
    requests = [make_request(list(range(50, 90)), 3, ignore_eos=True)]
    streams = [host.submit(request) for request in requests]
    seen = run_checking_plans(host, backend, streams)
    assert "alone" in seen
    first = [make_request([3, 4, 5], 30, ignore_eos=True), make_request([9, 8], 30, ignore_eos=True, seed=7)]
    streams = [host.submit(request) for request in first]
    assert "admitted" in run_checking_plans(host, backend, streams, max_steps=1, until_finished=False)
    for _ in range(2):
        host.step()
    later = [
        make_request(list(range(1, 45)), 10, ignore_eos=True),
        make_request([6, 6, 2], 8, ignore_eos=True),
    ]
    streams += [host.submit(request) for request in later]
    seen = run_checking_plans(host, backend, streams)
    assert {"took", "rows", "chunk", "riding", "drafts"} <= seen, seen
    assert [read_reply(stream) for stream in streams] == [backend.solo_reply(r) for r in first + later]
    backend.assert_clean()


def test_a_plan_that_preempts_changes_nothing_until_it_is_applied():
    """A pool too small for every stream's next block: the plan names the streams to preempt, the
    newest first, while they still hold their lanes; applied, they go back to the queue, and every
    reply still equals its solo run."""
    backend = LoggedFake(num_lanes=4, room=48, block_size=4, max_prefill_tokens=16)
    host = make_host(backend)
    requests = [make_request([1 + k, 2, 3, 4, 5], 24, ignore_eos=True, seed=k or None) for k in range(4)]
    streams = [host.submit(request) for request in requests]
    preempting = []
    for _ in range(500):
        if all(stream.finished is not None for stream in streams):
            break
        plan = plan_twice(host, backend)
        if plan.preempted:
            lanes = {job.lane: job for job in host._lanes.jobs()}
            assert all(lane in lanes for lane in plan.preempted)  # still held: nothing applied yet
            newest = max(lanes.values(), key=lambda job: job.admitted_seq)
            assert plan.preempted[0] == newest.lane
            preempting.append(plan)
        host.step()
    assert preempting, "the pool never ran short"
    assert host.stats().preempted >= 1
    assert [read_reply(stream) for stream in streams] == [backend.solo_reply(r) for r in requests]
    backend.assert_clean()


def test_two_hosts_in_the_same_state_make_the_same_plans():
    """A plan is a function of the scheduler's state alone: two hosts given the same requests plan
    every step alike (plain data compares across hosts; nothing in a plan names a host's objects)."""
    hosts, backends, streams = [], [], []
    for _ in range(2):
        backend = LoggedFake(num_lanes=3, room=96, block_size=4, max_prefill_tokens=16, repeat_period=3)
        host = make_host(backend, prefix_caching=True, max_draft_tokens=3, step_tokens=20)
        requests = [
            make_request([2, 3, 2, 3], 20, ignore_eos=True),
            make_request(list(range(7, 40)), 9, seed=3),
        ]
        requests += [make_request([2, 3, 2, 3, 5], 14, ignore_eos=True, background=True)]
        hosts.append(host)
        backends.append(backend)
        streams.append([host.submit(request) for request in requests])
    plans = [[], []]
    for _ in range(300):
        if all(stream.finished is not None for stream in streams[0] + streams[1]):
            break
        for index, host in enumerate(hosts):
            plans[index].append(plan_twice(host, backends[index]))
            host.step()
    assert plans[0] == plans[1] and any(plan.rows for plan in plans[0])
    assert [read_reply(s) for s in streams[0]] == [read_reply(s) for s in streams[1]]
    for backend in backends:
        backend.assert_clean()


def test_prompts_taken_while_nothing_decodes_are_their_steps_plan():
    """A burst taken while nothing decodes: admission opens its lanes and books its blocks but runs
    no pass; the step's plan holds the whole prompts, `joint` naming the ones that share its one
    pass (all or none), and that pass is the step's only one. A poisoned prompt makes the joint
    pass refused: each prompt then goes alone, only the poisoned one fails, and later bursts' plans
    grow back to the whole burst. Every other reply equals its solo run."""
    backend = LoggedFake(batched=True, num_lanes=8, max_prefill_tokens=16)
    backend.poisoned_prompts = {37}
    backend.refuse_poisoned_passes = True
    host = make_host(backend)
    bursts = [[make_request([36 + k, 2, 3], 4, ignore_eos=True) for k in range(4)]]  # 37: refused jointly
    bursts += [[make_request([k, 5, 6], 4, ignore_eos=True) for k in range(b, b + 4)] for b in (10, 20, 30)]
    for index, burst in enumerate(bursts):
        streams = [host.submit(request) for request in burst]
        num_calls = len(backend.calls)
        seen = run_checking_plans(host, backend, streams, max_steps=1, until_finished=False)
        assert {"alone", "joint", "admitted"} <= seen, seen
        calls = backend.calls[num_calls:]
        num_taken = calls.index("prefill_many")
        assert calls[:num_taken] == ["open"] * num_taken and (index or num_taken == 4), calls
        run_checking_plans(host, backend, streams)
        replies = [read_reply(stream) for stream in streams]
        for request, reply in zip(burst, replies):
            if 37 not in request.prompt_ids:
                assert reply == backend.solo_reply(request)
    assert backend.refused_passes and backend.joint_passes[-1] == 4, backend.joint_passes
    backend.assert_clean()


def test_a_plan_takes_jobs_and_yields_lanes_before_anything_of_it_runs():
    """A background stream holds the only lane when a foreground request arrives: the plan names
    the lane it yields, then the job it takes with the lane that job opens, while nothing has
    changed (asked twice, the same); the step applies that very plan, and both replies equal their
    solo runs (the yielded stream is recomputed when taken again)."""
    backend = LoggedFake(num_lanes=1, room=64, block_size=4, max_prefill_tokens=16)
    host = make_host(backend)
    background = make_request([4, 5, 6], 12, ignore_eos=True, background=True)
    foreground = make_request([7, 8], 5, ignore_eos=True)
    streams = [host.submit(background)]
    for _ in range(3):
        host.step()
    (held,) = host._lanes.jobs()
    streams.append(host.submit(foreground))
    plan = plan_twice(host, backend)
    yielded, opening = plan.admitted
    assert yielded == Yielded(held.lane) and host._lanes.jobs() == [held], "nothing applied yet"
    assert (opening.lane, opening.rides, opening.num_cached) == (held.lane, True, 0)
    seen = run_checking_plans(host, backend, streams)
    assert {"took", "yielded"} <= seen, seen
    assert [read_reply(stream) for stream in streams] == [
        backend.solo_reply(background),
        backend.solo_reply(foreground),
    ]
    backend.assert_clean()


def test_a_plan_the_queue_no_longer_fits_is_made_again_without_its_takes():
    """The plan takes a background job; a foreground request arrives before the step applies it:
    the queue's head is no longer the job the plan named, so nothing is taken, the step's plan is
    made again from what then is (admitting nothing), and the foreground job is taken next step.
    Every reply equals its solo run."""
    backend = LoggedFake(num_lanes=2, room=64, block_size=4, max_prefill_tokens=16)
    host = make_host(backend)
    late = make_request([9, 9, 3], 4, ignore_eos=True)
    first = make_request([2, 3, 4], 4, ignore_eos=True, background=True)
    streams = [host.submit(first)]
    scheduler = host._scheduler
    schedule = scheduler.schedule
    asked = []

    def arriving_meanwhile(admit=True):
        plan = schedule(admit=admit)
        asked.append((admit, plan))
        if len(streams) == 1:
            streams.append(host.submit(late))  # after the plan, before the step applies it
        return plan

    scheduler.schedule = arriving_meanwhile
    host.step()
    scheduler.schedule = schedule
    (took, again) = asked
    assert took[0] and [type(step) for step in took[1].admitted] == [Opening]
    assert not again[0] and again[1].admitted == () and host._lanes.jobs() == [], "nothing taken"
    assert host._state.num_queued() == 2
    run_checking_plans(host, backend, streams)
    assert [read_reply(stream) for stream in streams] == [backend.solo_reply(first), backend.solo_reply(late)]
    backend.assert_clean()

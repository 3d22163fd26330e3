"""The scheduler's step: what one scheduling iteration does with the lanes and the backend.

Each step is planned whole before anything of it runs: `schedule()` returns a StepPlan of plain
data (step_plan.py), changing nothing and calling nothing on the engine: the streams that end; the
waiting jobs it takes, the lanes they open on the shared blocks of their cached prefixes and the
blocks they book, and the background streams that yield for them (admit_plan.py, admit_choice.py
choosing; tried on scratch copies); the streams it preempts; every live stream's rows, the long
prompt's next chunk and the whole prompts admitted this step beside them, the blocks it books; with
nothing decoding, the whole prompts of its one prompt pass (`joint`: those that go together, all or
none), else the chunk. The plan is applied in that order (its admission checked to open every lane
as planned), its one pass runs (round_pass.py, or Admission.run_prompts), and `update_from_output()`
applies the sampled tokens (sampled_tokens.py), one way (STYLE 14). What a prompt pass reports
(admit_outcomes.py) the scheduler applies: the streams and which job is chunking are the
scheduler's alone, the queue is HostState's (peeked and taken under its lock, never held across a
backend call). A BackendBroken anywhere latches the host broken: every stream ends with an error,
new work is refused and `on_broken` is called once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from tpserve.ranks.step_profile import NoProfile, StepProfile
from tpserve.server.admit_outcomes import BlockWait, Ended, FirstToken, Outcome
from tpserve.server.admit_plan import AdmitStep, ScratchBackend, ScratchQueue, Yielded, plan_admission
from tpserve.server.backend import Backend, BackendBroken
from tpserve.server.drafts import Drafter
from tpserve.server.host_state import HostState
from tpserve.server.lane_admit import MAX_JOINT_PROMPTS, Admission
from tpserve.server.lane_job import Job
from tpserve.server.lane_table import LaneTable
from tpserve.server.requests import CANCELLED, ERROR
from tpserve.server.round_pass import round_items, run_round
from tpserve.server.sampled_tokens import End, SampledTokens
from tpserve.server.step_plan import StepPlan, plan_round

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        backend: Backend,
        state: HostState,
        admission: Admission,
        lanes: LaneTable,
        tokens: SampledTokens,
        *,
        drafter: Drafter | None,
        on_broken: Callable[[str], None] | None,
        profile: StepProfile | NoProfile,
    ):
        self._backend = backend
        self._state = state
        self._admission = admission
        self.lanes = lanes
        self._drafter = drafter
        self._tokens = tokens
        self._on_broken = on_broken
        self._profile = profile
        self._step_lock = threading.Lock()
        self._chunking: Job | None = None  # the one job whose long prompt goes in chunks
        self._riding: list[Job] = []  # whole prompts admitted this step: they go in its plan's pass
        self.num_preempted = 0  # streams that gave up their lane for want of KV blocks (read by stats)

    def step(self) -> bool:
        """One scheduling iteration. False when there was nothing it could do."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("step() is already running on another thread")
        ran = False
        self._profile.begin_step()
        try:
            if self._state.broken_reason is not None:
                return False
            try:
                ran = self._run_step()
                return ran
            except BackendBroken as error:
                self.latch_broken(str(error))
                return False
        finally:
            self._profile.end_step(ran)
            self._step_lock.release()

    def _run_step(self) -> bool:
        """Plan the step, end the streams it ends, apply its admission, run its one pass. True when
        anything ran or changed. A plan whose admission no longer fits the queue (a cancel or an
        arrival since it was made) is made again from what then is, taking nothing more this step."""
        with self._profile.part("plan"):
            plan = self.schedule(admit=not self._state.stopping)
        changed = self._end_finished(plan)
        if plan.admitted:
            changed = True
            if not self._admit(plan.admitted):
                with self._profile.part("plan"):
                    plan = self.schedule(admit=False)
                self._end_finished(plan)
        return self._decode_round(plan) or changed

    def _end_finished(self, plan: StepPlan) -> bool:
        """End the plan's cancelled streams (their lanes close first: the rest of the plan counts on it)."""
        for lane in plan.finished:
            self._end(self.lanes.job_on(lane), CANCELLED)
        return bool(plan.finished)

    def _admit(self, admitted: tuple[AdmitStep, ...]) -> bool:
        """Apply the plan's admission (admit_plan.py), in order: a yield closes the stream's lane
        and requeues it; a take pops the job the plan named, opens its lane (which must open as
        planned: the plan was made from this very state) and books its prompt's blocks. False, with
        the rest left undone, when the queue's head is not the job the plan named (cancelled or
        overtaken since), or the job taken was cancelled before its lane opened: it is never
        launched."""
        for step in admitted:
            if isinstance(step, Yielded):
                self._yield_lane(self.lanes.job_on(step.lane))
                continue
            head = self._state.peek_many(1)
            taken = self._state.take_head(head) if head and head[0].seq == step.job else []
            if not taken:
                return False
            job = taken[0]
            if job.cancel_requested:
                self._end(job, CANCELLED)
                return False
            self.lanes.open(job, 0)
            opened = (job.lane, tuple(job.blocks), job.cached_tokens)
            if opened != (step.lane, step.blocks, step.num_cached):
                raise RuntimeError(
                    f"the step's plan opened lane {step.lane} so; the lane table opened {opened}"
                )
            if step.rides:
                self.lanes.book(step.booked)
                self.lanes.append(job, step.booked)
                self._riding.append(job)
            elif step.chunks:
                self._chunking = job
            else:
                self._give_up_lane(job)
        return True

    def _give_up_lane(self, job: Job) -> None:
        """The job's lane closes (its blocks freed) and it goes back to the front of its line, to
        re-prefill its prompt and every token it produced when taken again: position-keyed sampling
        then continues exactly where it left off."""
        if job is self._chunking:
            self._chunking = None
        self._unride(job)
        self.lanes.close(job)
        if not self._state.requeue(job):
            self._end(job, CANCELLED)

    def _yield_lane(self, job: Job) -> None:
        """A background stream gives up its lane and goes back to the front of the background line."""
        self._give_up_lane(job)
        log.debug("background stream yielded its lane after %d tokens", len(job.produced))

    def _preempt(self, job: Job) -> None:
        """The stream gives up its lane for want of KV blocks; it is recomputed when taken again."""
        self._give_up_lane(job)
        self.num_preempted += 1
        log.info("a stream was preempted for KV blocks after %d tokens", len(job.produced))

    def _unride(self, job: Job) -> None:
        self._riding = [ride for ride in self._riding if ride is not job]

    def _apply(self, outcomes: list[Outcome]) -> None:
        """What a prompt pass reports (Admission's), in its order."""
        for outcome in outcomes:
            match outcome:
                case FirstToken(job, token):
                    if job is self._chunking:
                        self._chunking = None  # its last chunk went
                    self._end_if(job, self._tokens.first(job, token))
                case Ended(job, reason, error):
                    self._end(job, reason, error)
                case BlockWait(job):
                    if job is not self._chunking:  # the chunking job waits a step for its blocks
                        self._give_up_lane(job)

    def schedule(self, admit: bool = True) -> StepPlan:
        """This step as a plan (step_plan.py): the streams that end, then (`admit`) the waiting jobs
        it takes, the lanes they open and the blocks they book (admit_plan.py, tried on scratch
        copies of the lane table, the queue's head and the jobs), then its one pass, with the
        prompts admitted in it. Decided from the lanes, the KV book, the queue and the scheduler's
        notes, changing nothing and calling nothing on the engine."""
        drafts = self._drafter.drafts if self._drafter else None
        sizes = (self._admission.chunk_size, self._admission.joint_prompts)
        if not (admit and self._may_admit() and self._state.has_waiting()):
            return plan_round(self.lanes, self._chunking, self._riding, drafts, *sizes)
        lanes, copies = self.lanes.scratch(ScratchBackend())
        finished = [job for job in self.lanes.jobs() if job.cancel_requested]
        for job in finished:
            lanes.close(copies[job])
        chunking = None if self._chunking in (None, *finished) else copies[self._chunking]
        riding = [copies[job] for job in self._riding if job not in finished]
        head = self._state.peek_many(self.lanes.num_lanes + MAX_JOINT_PROMPTS)
        queue = ScratchQueue([job.scratch() for job in head])
        admitted, chunking, riding = plan_admission(lanes, queue, self._admission, chunking, riding)
        if drafts is not None:
            drafts = _on_originals(drafts, {copy: job for job, copy in copies.items()})
        plan = plan_round(lanes, chunking, riding, drafts, *sizes)
        return dataclasses.replace(plan, finished=tuple(job.lane for job in finished), admitted=admitted)

    def _may_admit(self) -> bool:
        """Whether admission could take or yield anything (a lane free or freed by a cancel, or a
        background stream that could yield one): else no scratch copy is made for it."""
        jobs = self.lanes.jobs()
        return self.lanes.num_free > 0 or any(job.background or job.cancel_requested for job in jobs)

    def _decode_round(self, plan: StepPlan) -> bool:
        """The step's one pass: a decode round over every live stream, with the whole prompts
        admitted this step and the long prompt's next chunk in the same pass (those alone when no
        stream decodes): plan it, apply the plan, one pass, apply the sampled tokens. True when
        anything ran."""
        jobs = {job.lane: job for job in self.lanes.jobs()}
        for lane in plan.preempted:
            self._preempt(jobs[lane])
        self.lanes.book(plan.booked)
        for rows in (*plan.rows, *plan.prompts):
            self.lanes.append(jobs[rows.lane], rows.blocks[len(rows.blocks) - rows.num_booked :])
        if not plan.rows:
            return self._prompts_alone(plan)
        self._riding = []  # every one rides in this plan's pass
        live = [jobs[rows.lane] for rows in plan.rows]
        if self._drafter:
            self._drafter.advance(live)
        self._profile.decoded(len(live), plan.num_rows)
        items = round_items(plan, live)
        prompts = [self._admission.prompt_item(jobs[p.lane], p.start, p.num_tokens) for p in plan.prompts]
        samples, refused = run_round(self._backend, items, [rows.draft for rows in plan.rows], prompts)
        self.update_from_output(plan, samples, refused)
        return True

    def _prompts_alone(self, plan: StepPlan) -> bool:
        """A plan in which nothing decodes: its whole prompts in a pass of their own (the plan's
        `joint` ones together, any other alone), else the chunk. True when anything ran or a chunk
        waits for its blocks."""
        riding, self._riding = self._riding, []
        chunking = self._chunking
        if riding:
            self._profile.prefilled()  # a prompt step, whatever the backend tells the timers
            joint = [job for job in riding if job.lane in plan.joint]
            self._apply(self._admission.run_prompts(riding, joint))
        if (
            chunking is not None
            and self._chunking is chunking
            and chunking.lane in [p.lane for p in plan.prompts]
        ):
            self._apply(self._admission.prefill_chunk(chunking))
        return bool(riding) or chunking is not None

    def update_from_output(self, plan: StepPlan, samples: list[list[int]], refused: bool) -> None:
        """Apply what the plan's pass sampled: each stream's kept tokens (its drafts' up to the first
        wrong guess), each prompt's progress and the first token of each that ended. `refused`: the
        pass went again without its prompts (`samples` then holds the round's alone), and each
        prompt runs alone now, so only a refused one fails."""
        jobs = {job.lane: job for job in self.lanes.jobs()}
        live = [jobs[rows.lane] for rows in plan.rows]
        prompt_jobs = [jobs[p.lane] for p in plan.prompts]
        prompt_tokens = iter([] if refused else [tokens[0] for tokens in samples[len(live) :]])
        samples = samples[: len(live)]
        if [len(tokens) for tokens in samples] != [1 + len(rows.draft) for rows in plan.rows]:
            raise BackendBroken(f"a decode round returned {len(samples)} lanes' tokens for {len(live)} lanes")
        for job in live:
            self.lanes.sent(job)
        with self._profile.part("tokens"):
            for job, rows, tokens in zip(live, plan.rows, samples):
                for token in self._drafter.kept(job, rows.draft, tokens) if rows.draft else tokens:
                    self._end_if(job, self._tokens.take(job, token))
                    if job.lane is None:  # the reply ended: later tokens are not part of it
                        break
        if refused:
            chunked = self._chunking is not None and self._chunking in prompt_jobs
            self._alone_after_refusal(chunked, [job for job in prompt_jobs if job is not self._chunking])
            return
        for job, prompt in zip(prompt_jobs, plan.prompts):
            token = next(prompt_tokens, None) if prompt.last else None
            outcome = self._admission.prefilled(job, prompt.start + prompt.num_tokens, prompt.last, token)
            self._apply([] if outcome is None else [outcome])

    def _alone_after_refusal(self, chunked: bool, riding: list[Job]) -> None:
        """Some rank refused a prompt beside the round (nothing of that pass ran): each runs alone,
        so only the refused one fails."""
        if chunked:
            self._apply(self._admission.prefill_chunk(self._chunking))
        self._apply(self._admission.run_alone(riding))

    def _end_if(self, job: Job, end: End | None) -> None:
        """End the stream when its token ended it (sampled_tokens.py)."""
        if end is not None:
            self._end(job, *end)

    def end_all(self, reason: str) -> None:
        """End every stream holding a lane (a stop's deadline passed)."""
        for job in self.lanes.jobs():
            self._end(job, reason)

    def _end(self, job: Job, reason: str, error: str | None = None) -> None:
        """Close the job's lane if it holds one, then send Finished."""
        if job is self._chunking:
            self._chunking = None  # no more of its chunks go
        self._unride(job)
        if job.lane is not None:
            self.lanes.close(job)
        self._state.finish(job, reason, error)

    def latch_broken(self, reason: str, forget_lanes: bool = True) -> None:
        """On the scheduler thread (or with none running): forget_lanes; from another, not."""
        jobs = self._state.latch_broken(reason)
        if jobs is None:
            return
        log.error("engine broken: %s; ending %d streams", reason, len(jobs))
        if forget_lanes:
            self.lanes.forget_all()
            self._chunking = None
            self._riding = []
        for job in jobs:
            self._state.finish(job, ERROR, f"engine broken: {reason}")
        if self._on_broken is not None:
            try:
                self._on_broken(reason)
            except Exception:
                log.exception("the on_broken callback failed")


def _on_originals(drafts, originals: dict[Job, Job]):
    """The drafter's `drafts` asked of scratch copies' streams: it knows the streams themselves."""
    return lambda live: drafts([originals[job] for job in live])

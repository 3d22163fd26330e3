"""Admission: getting waiting jobs from the queue into lanes, up to each one's first sampled token.

Three steps per job, as in the design: take it off the queue, set it up (lane and KV reservation,
then a prompt-cache lookup and restore), launch it (its own prefill, chunks of a long prompt between
decode rounds, or one prefill_many with other jobs). A refusal or failure ends that job alone and
frees what it held; only BackendBroken goes further (the host latches broken).

Admission decides and runs the passes; it never touches the host's lock, queue or streams. Each call
returns what happened (the jobs to take, the stream to yield, outcomes: a first token, an end, a
prompt that goes in chunks) and the lane host applies that itself, one way (STYLE 14, like vLLM v1's
schedule() / update_from_output()). Which job is chunking is the host's to record; it is passed in.

A foreground job that cannot get a lane or room makes the newest background stream yield its lane;
the yielded job goes back to the front of the background line and later re-prefills its prompt and
the tokens it already produced, so position-keyed sampling continues exactly where it left off.

A step prefills at most `max_prefill_tokens` prompt tokens of whole prompts (its first pass always
goes), so a burst delays the live streams' next decode round by about one pass. With a prompt cache
(lane_cache.py), setup restores a job's cached prefix and its prompt is kept once prefilled. Whether
a prompt needs chunks, and how much of the budget it takes, is judged at take time by what the
cache would restore, so a mostly cached prompt can join a joint pass; one whose restore then fails
launches alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tpserve.server.backend import Backend, BackendBroken, PrefillItem, attempt
from tpserve.server.lane_cache import keep_prompt, restore_prefix
from tpserve.server.lane_job import Job
from tpserve.server.lane_table import LaneTable
from tpserve.server.prompt_cache import PromptCache
from tpserve.server.requests import CANCELLED, ERROR

log = logging.getLogger(__name__)

MAX_JOINT_PROMPTS = 16  # the most prompts one prefill_many pass takes (the Backend contract)


@dataclass(frozen=True)
class FirstToken:
    """The job's whole prompt is in its lane and the backend sampled its next token."""

    job: Job
    token: int


@dataclass(frozen=True)
class Ended:
    """The job ends here (cancelled, refused, or its prefill failed): close its lane if it holds one."""

    job: Job
    reason: str
    error: str | None = None


@dataclass(frozen=True)
class Chunking:
    """The job's long prompt goes in chunks from now on, one per step between decode rounds."""

    job: Job


Outcome = FirstToken | Ended | Chunking


class Admission:
    def __init__(
        self,
        backend: Backend,
        lanes: LaneTable,
        *,
        batch_prefill: bool,
        prompt_cache: PromptCache | None = None,
    ):
        self._backend = backend
        self._lanes = lanes
        self._cache = prompt_cache
        self._max_prefill_tokens = backend.max_prefill_tokens
        batches = batch_prefill and backend.batches_prompts
        # Halved whenever the backend refuses a pass (returns None): it said it cannot take that many.
        self.max_joint_prompts = MAX_JOINT_PROMPTS if batches else 1
        self.max_iterations = 2 * lanes.num_lanes + 16  # bounds one step's admission however many jobs fail

    def _needs_chunks(self, job: Job) -> bool:
        """After setup: whether the prompt left past the restored prefix takes more than one pass."""
        return len(job.feed_ids) - job.cached_tokens > self._max_prefill_tokens

    def _expected_new_tokens(self, job: Job) -> int:
        """Before setup: the prompt tokens left past the prefix the prompt cache would restore now.

        A forecast only (setup's restore may still fail); `launch` copes when it was wrong.
        """
        hit = 0 if self._cache is None else self._cache.cached_length(job.cache_ids)
        return len(job.feed_ids) - hit

    def _expects_chunks(self, job: Job) -> bool:
        """Before setup: `_needs_chunks`, counting the prefix the prompt cache would restore now."""
        return self._expected_new_tokens(job) > self._max_prefill_tokens

    def can_take(self, num_free: int, budget: int | None) -> bool:
        """Whether a take is worth asking the backend's free room for (the queue holds a job)."""
        return num_free > 0 and (budget is None or budget > 0)

    def num_to_take(
        self, head: Sequence[Job], free_room: int, budget: int | None, chunking: Job | None
    ) -> tuple[int, int]:
        """How many of the queue's head jobs to take: one, or several for one joint pass, only what
        fits in `head` (as many as lanes are free), `free_room` and `budget` (prompt tokens this step
        may still prefill; None: the step's first pass, which takes at least one job and at most
        one pass's worth). Returns that number and the budget left after them (a long prompt's
        chunks are not counted: they go one a step). No long prompt is taken while `chunking`."""
        num_tokens = 0
        limit = self._max_prefill_tokens if budget is None else budget
        num_taken = 0
        for job in head:
            if job.reserve > free_room:
                break
            new_tokens = self._expected_new_tokens(job)
            long = new_tokens > self._max_prefill_tokens
            if long and (num_taken or chunking is not None):
                break
            new_tokens = 0 if long else new_tokens
            if num_tokens + new_tokens > limit and (num_taken or budget is not None):
                break
            num_tokens += new_tokens
            num_taken += 1
            free_room -= job.reserve
            if long:
                break
        return num_taken, limit - num_tokens

    def launch(self, jobs: list[Job], chunking: Job | None) -> list[Outcome]:
        """Set up the taken jobs and launch them: short prompts in one joint pass when two or more,
        the rest alone. `chunking`: the job whose prompt goes in chunks now, if any."""
        outcomes: list[Outcome] = []
        ready = []
        for job in jobs:
            refusal = self._setup(job)
            if refusal is None:
                ready.append(job)
            else:
                outcomes.append(refusal)
        # A job taken as short can turn out long when its restore failed: it launches alone. Jobs
        # whose restores failed can also be short each and too long together: the joint pass takes
        # them while they fit in one pass, the rest go alone.
        whole, num_tokens = [], 0
        for job in ready:
            new_tokens = len(job.feed_ids) - job.cached_tokens
            if num_tokens + new_tokens <= self._max_prefill_tokens:
                whole.append(job)
                num_tokens += new_tokens
        if len(whole) >= 2:
            joint = self._prefill_together(whole)
            if joint is not None:
                outcomes += joint
                ready = [job for job in ready if job not in whole]
        for job in ready:
            if job.cancel_requested:
                outcomes.append(Ended(job, CANCELLED))
            elif not self._needs_chunks(job):
                outcomes.append(self._prefill(job, self._whole_prompt(job)))
            elif chunking is None:
                chunking = job  # its chunks run one per step, between decode rounds
                outcomes.append(Chunking(job))
            else:
                outcomes.append(self._prefill_all_chunks(job))
        return outcomes

    def _setup(self, job: Job) -> Ended | None:
        """Lane and reservation. None when the job is ready, else how it ended (cancelled or refused)."""
        if job.cancel_requested:
            return Ended(job, CANCELLED)
        opened, error = attempt(self._lanes.open, job)
        if error is not None:
            return Ended(job, ERROR, f"could not reserve {job.reserve} tokens of KV room: {error}")
        if not opened:
            return Ended(job, ERROR, f"the engine refused to reserve {job.reserve} tokens of KV room")
        job.cached_tokens = restore_prefix(self._cache, self._backend, job)
        job.num_prefilled = job.cached_tokens
        return None

    def _prefill_together(self, jobs: list[Job]) -> list[Outcome] | None:
        """One prefill_many over `jobs`. None when the backend refused or failed (none prefilled)."""
        items = [self._whole_prompt(job) for job in jobs]
        tokens, error = attempt(self._backend.prefill_many, items)
        if error is not None:
            log.warning(
                "a joint prompt pass over %d streams failed (%r); prefilling each alone", len(jobs), error
            )
            return None
        if tokens is None:
            self.max_joint_prompts = max(2, len(jobs) // 2)
            log.info(
                "the engine refused a joint prompt pass over %d streams; prefilling each alone", len(jobs)
            )
            return None
        if len(tokens) != len(jobs):
            raise BackendBroken(f"prefill_many returned {len(tokens)} tokens for {len(jobs)} prompts")
        outcomes: list[Outcome] = []
        for job, token in zip(jobs, tokens):
            job.num_prefilled = len(job.feed_ids)
            keep_prompt(self._cache, self._backend, job)
            outcomes.append(FirstToken(job, token))
        return outcomes

    def _prefill_all_chunks(self, job: Job) -> Outcome:
        """Every chunk now: a job taken as short whose restore failed while another job chunks.

        Safe: no pass exceeds max_prefill_tokens, only one job is ever chunking, and the job has its
        first token before a decode round sees its lane. The price (this step's decode round waits)
        is paid only after a failed restore; requeueing it would need a foreground front place.
        """
        while True:
            outcome = self._prefill(job, self._next_chunk(job))
            if outcome is not None:  # the last chunk's first token, or a failed chunk's end
                return outcome

    def prefill_chunk(self, job: Job) -> list[Outcome]:
        """The next chunk of `job`'s long prompt. No outcome while more chunks are to come."""
        if job.cancel_requested:
            return [Ended(job, CANCELLED)]
        outcome = self._prefill(job, self._next_chunk(job))
        return [] if outcome is None else [outcome]

    def _next_chunk(self, job: Job) -> PrefillItem:
        feed = job.feed_ids
        start = job.num_prefilled
        chunk = feed[start : start + self._max_prefill_tokens]
        last = start + len(chunk) == len(feed)
        return PrefillItem(job.lane, start, chunk, last, job.request.sampling, job.request.images, job.counts)

    def _whole_prompt(self, job: Job) -> PrefillItem:
        start = job.cached_tokens
        return PrefillItem(
            job.lane, start, job.feed_ids[start:], True, job.request.sampling, job.request.images, job.counts
        )

    def _prefill(self, job: Job, item: PrefillItem) -> Outcome | None:
        """One pass; None after a chunk that is not the prompt's last."""
        token, error = attempt(self._backend.prefill, item)
        if error is not None:
            return Ended(job, ERROR, f"prefill failed: {error}")
        job.num_prefilled = item.start + len(item.token_ids)
        if not item.last:
            return None
        if token is None:
            return Ended(job, ERROR, "the engine sampled no token after the prompt")
        keep_prompt(self._cache, self._backend, job)
        return FirstToken(job, token)

    def yielding_stream(self, waiting: Sequence[Job], chunking: Job | None) -> Job | None:
        """The newest background stream, when the foreground jobs among `waiting` (the queue's head)
        cannot all start without its lane; None when none should yield.

        Counts as many waiting foreground jobs as one admission could take together, but only
        those that yielding could make fit, so background work is never thrown away for nothing.
        """
        waiting = [job for job in waiting if not job.background]
        background = [job for job in self._lanes.jobs() if job.background]
        if not waiting or not background:
            return None
        if chunking is not None and self._expects_chunks(waiting[0]):
            return None  # the head waits for the chunked prefill in progress, not for a lane
        num_free = self._lanes.num_free
        free_room = self._backend.free_room()
        spare_lanes = num_free + len(background)
        spare_room = free_room + sum(job.reserve for job in background)
        num_wanted = wanted_room = 0
        for job in waiting:
            if num_wanted == spare_lanes or wanted_room + job.reserve > spare_room:
                break
            num_wanted += 1
            wanted_room += job.reserve
        if num_wanted == 0 or (num_free >= num_wanted and free_room >= wanted_room):
            return None
        return max(background, key=lambda job: job.admitted_seq)

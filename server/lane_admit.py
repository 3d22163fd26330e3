"""Admission: getting waiting jobs from the queue into lanes, up to each one's first sampled token.

Three steps per job, as in the design: take it off the queue (under the host's lock), set it up
(lane and KV reservation, then a prompt-cache lookup and restore), launch it (its own prefill, chunks of a long
prompt between decode rounds, or one prefill_many with other jobs). A refusal or failure ends that
job alone and frees what it held; only BackendBroken goes further (the host latches broken).

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
import threading
from collections.abc import Callable

from tpserve.server.backend import Backend, BackendBroken, PrefillItem, attempt
from tpserve.server.job_queue import JobQueue
from tpserve.server.lane_cache import keep_prompt, restore_prefix
from tpserve.server.lane_job import Job
from tpserve.server.lane_table import LaneTable
from tpserve.server.prompt_cache import PromptCache
from tpserve.server.requests import CANCELLED, ERROR

log = logging.getLogger(__name__)

MAX_JOINT_PROMPTS = 16  # the most prompts one prefill_many pass takes (the Backend contract)

EndJob = Callable[..., None]  # end(job, reason, error=None): close its lane if held, send Finished


class Admission:
    def __init__(
        self,
        backend: Backend,
        lanes: LaneTable,
        queue: JobQueue[Job],
        lock: threading.Condition,
        *,
        batch_prefill: bool,
        first_token: Callable[[Job, int], None],
        end: EndJob,
        prompt_cache: PromptCache | None = None,
    ):
        self._backend = backend
        self._lanes = lanes
        self._queue = queue
        self._lock = lock
        self._first_token = first_token
        self._end = end
        self._cache = prompt_cache
        self._max_prefill_tokens = backend.max_prefill_tokens
        batches = batch_prefill and backend.batches_prompts
        # Halved whenever the backend refuses a pass (returns None): it said it cannot take that many.
        self.max_joint_prompts = MAX_JOINT_PROMPTS if batches else 1
        self.chunking: Job | None = None  # the one job whose long prompt goes in chunks
        self._max_iterations = 2 * lanes.num_lanes + 16  # bounds one admit() however many jobs fail

    def forget(self, job: Job) -> None:
        """The host ended `job`: if its long prompt was going in chunks, no more of them go."""
        if job is self.chunking:
            self.chunking = None

    def forget_all(self) -> None:
        """The engine broke: nothing is in progress any more."""
        self.chunking = None

    def admit(self) -> bool:
        """Admit waiting jobs while lanes, room and this step's prompt budget allow. True when
        anything changed.

        The budget is `max_prefill_tokens` prompt tokens per step, so a burst of prompts delays the
        live streams' next decode round by about one pass, whether its prompts go alone or
        together; the step's first pass always goes, so the queue always moves.
        """
        changed = False
        budget = None  # None: nothing prefilled yet this step
        for _ in range(self._max_iterations):
            if self._yield_for_foreground():
                changed = True
                continue
            jobs, num_tokens = self._take_jobs(budget)
            if not jobs:
                break
            changed = True
            budget = (self._max_prefill_tokens if budget is None else budget) - num_tokens
            ready = [job for job in jobs if self._setup(job)]
            # A job taken as short can turn out long when its restore failed: it launches alone.
            whole = [job for job in ready if not self._needs_chunks(job)]
            if len(whole) >= 2 and self._prefill_together(whole):
                ready = [job for job in ready if job not in whole]
            for job in ready:
                self._launch_alone(job)
        return changed

    def _needs_chunks(self, job: Job) -> bool:
        """After setup: whether the prompt left past the restored prefix takes more than one pass."""
        return len(job.feed_ids) - job.cached_tokens > self._max_prefill_tokens

    def _expected_new_tokens(self, job: Job) -> int:
        """Before setup: the prompt tokens left past the prefix the prompt cache would restore now.

        A forecast only (setup's restore may still fail); `_launch_alone` copes when it was wrong.
        """
        hit = 0 if self._cache is None else self._cache.cached_length(job.cache_ids)
        return len(job.feed_ids) - hit

    def _expects_chunks(self, job: Job) -> bool:
        """Before setup: `_needs_chunks`, counting the prefix the prompt cache would restore now."""
        return self._expected_new_tokens(job) > self._max_prefill_tokens

    def _take_jobs(self, budget: int | None) -> tuple[list[Job], int]:
        """Take the head job, or several for one joint pass: only what fits in free lanes, room and
        `budget` (prompt tokens this step may still prefill; None: the step's first pass, which
        takes at least one job and at most one pass's worth). Returns the jobs and the prompt
        tokens they will prefill now (a long prompt's chunks are not counted: they go one a step)."""
        num_free = self._lanes.num_free
        with self._lock:
            if num_free == 0 or self._queue.peek() is None or (budget is not None and budget <= 0):
                return [], 0
        free_room = self._backend.free_room()
        num_tokens = 0
        limit = self._max_prefill_tokens if budget is None else budget
        with self._lock:
            taken: list[Job] = []
            for job in self._queue.peek_many(min(self.max_joint_prompts, num_free)):
                if job.reserve > free_room:
                    break
                new_tokens = self._expected_new_tokens(job)
                long = new_tokens > self._max_prefill_tokens
                if long and (taken or self.chunking is not None):
                    break
                new_tokens = 0 if long else new_tokens
                if num_tokens + new_tokens > limit and (taken or budget is not None):
                    break
                num_tokens += new_tokens
                taken.append(job)
                free_room -= job.reserve
                if long:
                    break
            for _ in taken:
                self._queue.pop()
        return taken, num_tokens

    def _setup(self, job: Job) -> bool:
        """Lane and reservation. False when the job ended instead (cancelled or refused)."""
        if job.cancel_requested:
            self._end(job, CANCELLED)
            return False
        opened, error = attempt(self._lanes.open, job)
        if error is not None:
            self._end(job, ERROR, f"could not reserve {job.reserve} tokens of KV room: {error}")
            return False
        if not opened:
            self._end(job, ERROR, f"the engine refused to reserve {job.reserve} tokens of KV room")
            return False
        job.cached_tokens = restore_prefix(self._cache, self._backend, job)
        job.num_prefilled = job.cached_tokens
        return True

    def _prefill_together(self, jobs: list[Job]) -> bool:
        """One prefill_many over `jobs`. False when the backend refused or failed (none prefilled)."""
        items = [self._whole_prompt(job) for job in jobs]
        tokens, error = attempt(self._backend.prefill_many, items)
        if error is not None:
            log.warning(
                "a joint prompt pass over %d streams failed (%r); prefilling each alone", len(jobs), error
            )
            return False
        if tokens is None:
            self.max_joint_prompts = max(2, len(jobs) // 2)
            log.info(
                "the engine refused a joint prompt pass over %d streams; prefilling each alone", len(jobs)
            )
            return False
        if len(tokens) != len(jobs):
            raise BackendBroken(f"prefill_many returned {len(tokens)} tokens for {len(jobs)} prompts")
        for job, token in zip(jobs, tokens):
            job.num_prefilled = len(job.feed_ids)
            keep_prompt(self._cache, self._backend, job)
            self._first_token(job, token)
        return True

    def _launch_alone(self, job: Job) -> None:
        if job.cancel_requested:
            self._end(job, CANCELLED)
        elif not self._needs_chunks(job):
            self._prefill(job, self._whole_prompt(job))
        elif self.chunking is None:
            self.chunking = job  # its chunks run one per step, between decode rounds
        else:
            self._prefill_all_chunks(job)

    def _prefill_all_chunks(self, job: Job) -> None:
        """Every chunk now: a job taken as short whose restore failed while another job chunks.

        Safe: no pass exceeds max_prefill_tokens, only one job is ever `chunking`, and the job has its
        first token before a decode round sees its lane. The price (this step's decode round waits)
        is paid only after a failed restore; requeueing it would need a foreground front place.
        """
        while job.lane is not None:  # _prefill ends the job (closing its lane) when a chunk fails
            item = self._next_chunk(job)
            self._prefill(job, item)
            if item.last:
                return

    def prefill_chunk(self) -> bool:
        """The next chunk of the long prompt in progress, if any. True when one ran (or ended)."""
        job = self.chunking
        if job is None:
            return False
        if job.cancel_requested:
            self._end(job, CANCELLED)
            return True
        self._prefill(job, self._next_chunk(job))
        return True

    def _next_chunk(self, job: Job) -> PrefillItem:
        feed = job.feed_ids
        start = job.num_prefilled
        chunk = feed[start : start + self._max_prefill_tokens]
        last = start + len(chunk) == len(feed)
        return PrefillItem(job.lane, start, chunk, last, job.request.sampling, job.request.images)

    def _whole_prompt(self, job: Job) -> PrefillItem:
        start = job.cached_tokens
        return PrefillItem(
            job.lane, start, job.feed_ids[start:], True, job.request.sampling, job.request.images
        )

    def _prefill(self, job: Job, item: PrefillItem) -> None:
        token, error = attempt(self._backend.prefill, item)
        if error is not None:
            self._end(job, ERROR, f"prefill failed: {error}")
            return
        job.num_prefilled = item.start + len(item.token_ids)
        if not item.last:
            return
        if job is self.chunking:
            self.chunking = None
        if token is None:
            self._end(job, ERROR, "the engine sampled no token after the prompt")
            return
        keep_prompt(self._cache, self._backend, job)
        self._first_token(job, token)

    def _yield_for_foreground(self) -> bool:
        """Free the newest background stream's lane when waiting foreground jobs cannot all start.

        Counts as many waiting foreground jobs as one admission could take together, but only
        those that yielding could make fit, so background work is never thrown away for nothing.
        """
        with self._lock:
            waiting = [job for job in self._queue.peek_many(self.max_joint_prompts) if not job.background]
        background = [job for job in self._lanes.jobs() if job.background]
        if not waiting or not background:
            return False
        if self.chunking is not None and self._expects_chunks(waiting[0]):
            return False  # the head waits for the chunked prefill in progress, not for a lane
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
            return False
        victim = max(background, key=lambda job: job.admitted_seq)
        if victim is self.chunking:
            self.chunking = None
        self._lanes.close(victim)
        with self._lock:
            cancelled = victim.cancel_requested
            if not cancelled:
                self._queue.push_front_background(victim)
        if cancelled:
            self._end(victim, CANCELLED)
        log.debug("background stream yielded its lane after %d tokens", len(victim.produced))
        return True

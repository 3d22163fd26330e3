"""The lane host: rank 0's scheduler, turning queued requests into streams of tokens on the backend's lanes.

One scheduling thread drives the backend (every Backend call happens there); clients submit, read
and cancel from any thread. The host's lock guards only the queue and the set of unfinished jobs
and is never held across a backend call, so submit, cancel and stats never wait on the engine.

Each step: end cancelled streams, admit waiting jobs, run one chunk of a long prompt, then one
decode round over every live lane (continuous batching: streams join and leave between rounds).
Admission (lane_admit.py) decides what to take and runs the prompt passes; it returns what happened
and the host applies it: the queue, the streams and which job is chunking are the host's alone.
A BackendBroken anywhere latches the host broken: every stream ends with an error, new work is
refused and `on_broken` is called once so the daemon can exit non-zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from tpserve.server.backend import Backend, BackendBroken, DecodeItem, attempt, check_backend
from tpserve.server.drafts import Drafter
from tpserve.server.job_queue import JobQueue
from tpserve.server.lane_admit import Admission, Chunking, Ended, FirstToken, Outcome
from tpserve.server.lane_job import Job, reserve_for
from tpserve.server.lane_stream import Stream
from tpserve.server.lane_table import LaneTable
from tpserve.server.prompt_cache import PromptCache
from tpserve.server.requests import (
    CANCELLED,
    ERROR,
    Finished,
    GenerationRequest,
    HostStats,
    HostUnavailable,
    Prefilled,
    TokenLogprob,
)

__all__ = ["LaneHost", "Stream", "HostStats"]

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle scheduler re-checks this often even without a wake-up (room can free up)
JOIN_MARGIN_S = 5.0  # stop() waits this long past the grace period for the scheduler thread


class LaneHost:
    def __init__(
        self,
        backend: Backend,
        *,
        detokenize: Callable[[Sequence[int]], str],
        eos_ids: frozenset[int],
        queue_size: int = 64,
        clock: Callable[[], float] = time.monotonic,
        batch_prefill: bool = True,
        on_broken: Callable[[str], None] | None = None,
        prompt_cache: PromptCache | None = None,
        max_draft_tokens: int = 0,
        draft_rows: int = 16,
        logprobs: Callable[[int, int], TokenLogprob | None] | None = None,
    ):
        """logprobs(lane, position): the backend's log probability of the token its last pass
        sampled there (rank 0's Leader.logprobs), for requests whose sampling asks; None: none."""
        check_backend(backend)
        if backend.num_lanes < 1 or backend.max_prefill_tokens < 1:
            raise ValueError(
                f"the backend needs at least one lane and one prompt token per pass "
                f"(num_lanes {backend.num_lanes}, max_prefill_tokens {backend.max_prefill_tokens})"
            )
        self._backend = backend
        self._detokenize = detokenize
        self._eos_ids = frozenset(eos_ids)
        self._clock = clock
        self._on_broken = on_broken
        self._logprobs = logprobs
        self._room = backend.room
        self._context_size = backend.context_size
        self._cond = threading.Condition()  # guards _queue, _alive and the flags below
        self._queue: JobQueue[Job] = JobQueue(queue_size)
        self._alive: set[Job] = set()  # every job not yet Finished, wherever it is
        self._broken_reason: str | None = None
        self._stopping = False
        self._failure: str | None = None  # set by fail(), latched by the scheduler thread
        self._stop_deadline = 0.0
        self._wake = False
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._lanes = LaneTable(backend)
        self._admission = Admission(
            backend, self._lanes, batch_prefill=batch_prefill, prompt_cache=prompt_cache
        )
        self._chunking: Job | None = None  # the one job whose long prompt goes in chunks
        self.prompt_cache = prompt_cache
        # Draft tokens (server/drafts.py) when asked for and the backend can check them.
        speculates = max_draft_tokens > 0 and backend.verifies_drafts
        if max_draft_tokens > 0 and not speculates:
            log.warning("draft tokens are off: %s does not verify drafts", type(backend).__name__)
        self.drafter = Drafter(max_draft_tokens, draft_rows) if speculates else None

    # ---- client side (any thread) ----

    @property
    def broken(self) -> bool:
        return self._broken_reason is not None

    def submit(self, request: GenerationRequest) -> Stream:
        """Queue a request. Raises QueueFull, HostUnavailable, or ValueError for a request that cannot run."""
        reserve = reserve_for(request, self._context_size)
        job = Job(
            request,
            reserve=reserve,
            detokenize=self._detokenize,
            submitted_at=self._clock(),
            cancel=self._cancel,
        )
        with self._cond:
            if self._broken_reason is not None:
                raise HostUnavailable(f"the engine is broken: {self._broken_reason}")
            if self._stopping:
                raise HostUnavailable("the server is stopping")
            never_fits = reserve > self._room
            if not never_fits:
                self._queue.push(job, background=request.background)
            self._alive.add(job)
            self._wake_scheduler()
        if never_fits:
            self._finish(
                job, ERROR, f"the request needs {reserve} tokens of KV room; the engine holds {self._room}"
            )
        return job.stream

    def _cancel(self, job: Job) -> None:
        with self._cond:
            if job not in self._alive:
                return
            queued = self._queue.remove(job)
            if not queued:
                job.cancel_requested = True  # the scheduler frees its lane at the next boundary
                self._wake_scheduler()
        if queued:
            self._finish(job, CANCELLED)

    def stats(self) -> HostStats:
        with self._cond:
            queued = len(self._queue)
        return HostStats(
            queued=queued,
            lanes_busy=self._lanes.num_busy,
            room_used=self._lanes.room_used,
            num_lanes=self._lanes.num_lanes,
            room=self._room,
            draft_tokens=self.drafter.num_drafted if self.drafter else 0,
            draft_tokens_accepted=self.drafter.num_accepted if self.drafter else 0,
        )

    def _wake_scheduler(self) -> None:
        """Called with the lock held."""
        self._wake = True
        self._cond.notify_all()

    # ---- scheduling (one thread) ----

    def step(self) -> bool:
        """One scheduling iteration. False when there was nothing it could do."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("step() is already running on another thread")
        try:
            if self.broken:
                return False
            try:
                changed = self._end_cancelled()
                if not self._stopping:
                    changed = self._admit() or changed
                changed = self._prefill_chunk() or changed
                return self._decode_round() or changed
            except BackendBroken as error:
                self._latch_broken(str(error))
                return False
        finally:
            self._step_lock.release()

    def _end_cancelled(self) -> bool:
        cancelled = [job for job in self._lanes.jobs() if job.cancel_requested]
        for job in cancelled:
            self._end(job, CANCELLED)
        return bool(cancelled)

    def _admit(self) -> bool:
        """Admit waiting jobs while lanes, room and this step's prompt budget allow (lane_admit.py
        says why that budget). True when anything changed."""
        changed = False
        budget = None  # None: nothing prefilled yet this step
        for _ in range(self._admission.max_iterations):
            with self._cond:
                waiting = self._queue.peek_many(self._admission.max_joint_prompts)
            victim = self._admission.yielding_stream(waiting, self._chunking)
            if victim is not None:
                self._yield_lane(victim)
                changed = True
                continue
            jobs, budget = self._take_jobs(budget)
            if not jobs:
                break
            changed = True
            self._apply(self._admission.launch(jobs, self._chunking))
        return changed

    def _take_jobs(self, budget: int | None) -> tuple[list[Job], int | None]:
        """Pop the head jobs Admission takes; with the step's prompt budget left after them."""
        num_free = self._lanes.num_free
        with self._cond:
            if not self._admission.can_take(num_free, budget) or self._queue.peek() is None:
                return [], budget
        free_room = self._backend.free_room()
        with self._cond:
            head = self._queue.peek_many(min(self._admission.max_joint_prompts, num_free))
            num_taken, budget = self._admission.num_to_take(head, free_room, budget, self._chunking)
            taken = [self._queue.pop() for _ in range(num_taken)]
        return taken, budget

    def _yield_lane(self, job: Job) -> None:
        """A background stream gives up its lane and goes back to the front of the background line."""
        if job is self._chunking:
            self._chunking = None
        self._lanes.close(job)
        with self._cond:
            cancelled = job.cancel_requested
            if not cancelled:
                self._queue.push_front_background(job)
        if cancelled:
            self._end(job, CANCELLED)
        log.debug("background stream yielded its lane after %d tokens", len(job.produced))

    def _prefill_chunk(self) -> bool:
        """The next chunk of the long prompt in progress, if any. True when one ran (or ended)."""
        if self._chunking is None:
            return False
        self._apply(self._admission.prefill_chunk(self._chunking))
        return True

    def _apply(self, outcomes: list[Outcome]) -> None:
        """What Admission reports, in its order."""
        for outcome in outcomes:
            match outcome:
                case Chunking(job):
                    self._chunking = job
                case FirstToken(job, token):
                    if job is self._chunking:
                        self._chunking = None  # its last chunk went
                    self._first_token(job, token)
                case Ended(job, reason, error):
                    self._end(job, reason, error)

    def _decode_round(self) -> bool:
        self._end_cancelled()
        live = [job for job in self._lanes.jobs() if job is not self._chunking]
        if not live:
            return False
        drafts = self.drafter.drafts(live) if self.drafter else [()] * len(live)
        items = [
            DecodeItem(job.lane, job.next_position, job.produced[-1], job.request.sampling, draft)
            for job, draft in zip(live, drafts)
        ]
        if any(drafts):
            samples, error = attempt(self._backend.decode_drafts, items)
        else:
            tokens, error = attempt(self._backend.decode, items)
            samples = [[token] for token in tokens] if error is None else None
        if error is not None:
            raise BackendBroken(f"a decode round failed: {error!r}") from error
        if [len(tokens) for tokens in samples] != [1 + len(draft) for draft in drafts]:
            raise BackendBroken(
                f"a decode round returned {len(samples)} lanes' tokens for {len(items)} lanes"
            )
        for job, draft, tokens in zip(live, drafts, samples):
            for token in self.drafter.kept(job, draft, tokens) if draft else tokens:
                self._take_token(job, token)
                if job.lane is None:  # the reply ended: later tokens are not part of it
                    break
        return True

    def _first_token(self, job: Job, token: int) -> None:
        if not job.prefilled_sent:
            job.prefilled_sent = True
            job.stream.put(Prefilled(cached_tokens=job.cached_tokens))
        self._take_token(job, token)

    def _take_token(self, job: Job, token: int) -> None:
        logprob = None
        if self._logprobs is not None and job.wants_logprobs and job.lane is not None:
            logprob = self._logprobs(job.lane, job.next_token_position)
        try:
            reason = job.accept(token, self._eos_ids, self._clock(), logprob)
        except Exception as error:  # a token the tokenizer cannot decode fails this stream alone
            self._end(job, ERROR, f"could not decode token {token}: {error}")
            return
        if reason is not None:
            self._end(job, reason)

    def _end(self, job: Job, reason: str, error: str | None = None) -> None:
        """Close the job's lane if it holds one, then send Finished."""
        if job is self._chunking:
            self._chunking = None  # no more of its chunks go
        if job.lane is not None:
            self._lanes.close(job)
        self._finish(job, reason, error)

    def _finish(self, job: Job, reason: str, error: str | None = None) -> None:
        with self._cond:
            if job not in self._alive:
                return
            self._alive.discard(job)
        job.stream.put(Finished(reason, job.usage(self._clock()), error))

    def _latch_broken(self, reason: str, forget_lanes: bool = True) -> None:
        """On the scheduler thread (or with none running): forget_lanes; from another, not."""
        with self._cond:
            if self._broken_reason is not None:
                return
            self._broken_reason = reason
            self._queue.drain()
            jobs = list(self._alive)
            self._cond.notify_all()
        log.error("engine broken: %s; ending %d streams", reason, len(jobs))
        if forget_lanes:
            self._lanes.forget_all()
            self._chunking = None
        for job in jobs:
            self._finish(job, ERROR, f"engine broken: {reason}")
        if self._on_broken is not None:
            try:
                self._on_broken(reason)
            except Exception:
                log.exception("the on_broken callback failed")

    # ---- the scheduling thread and shutdown ----

    def start(self) -> None:
        """Run the scheduler on a daemon thread; it sleeps on a condition when idle."""
        with self._cond:
            if self._thread is not None or self._stopping:
                raise RuntimeError("the lane host was already started or stopped")
            self._thread = threading.Thread(target=self._run, name="lane-host", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self.broken:
                with self._cond:
                    self._wake = False
                    stopping = self._stopping
                    failure = self._failure
                if failure is not None:
                    self._latch_broken(failure)
                    return
                if stopping:
                    self._drain()
                    return
                if not self.step():
                    self._going_idle()
                    with self._cond:
                        if not (self._wake or self._stopping or self.broken or self._failure):
                            self._cond.wait(IDLE_WAIT_S)
        except BaseException as error:
            log.exception("the lane host's scheduler failed")
            self._latch_broken(f"the lane host failed: {error!r}")

    def fail(self, reason: str) -> None:
        """From any thread: the engine is gone (a rank lost). Every stream ends now with an error,
        also while the scheduler sits in a backend call that may only fail at its timeout; the
        scheduler latches broken when it next looks (its lanes are its own to forget)."""
        with self._cond:
            self._failure = reason
            self._wake_scheduler()
        self._latch_broken(reason, forget_lanes=self._thread is None)

    def _going_idle(self) -> None:
        # A backend with followers tells them no message is coming soon (see ranks/channel.py),
        # so they wait off any collective timeout. It sends that once per idle spell. A broken
        # engine has no followers to tell.
        if self.broken:
            return
        try:
            self._backend.idle()
        except BackendBroken as error:
            self._latch_broken(str(error))

    def stop(self, grace_s: float) -> bool:
        """Stop admitting; live streams get grace_s to finish, the rest end cancelled. False when
        the scheduler is stuck in a backend call (a follower that does not answer)."""
        with self._cond:
            self._stopping = True
            self._stop_deadline = time.monotonic() + grace_s
            queued = self._queue.drain()
            self._wake_scheduler()
            thread = self._thread
        for job in queued:
            self._finish(job, CANCELLED)
        if thread is None:
            self._drain()
            return True
        if thread is threading.current_thread():
            return True  # called from on_broken on the scheduler thread: it is about to end by itself
        thread.join(timeout=grace_s + JOIN_MARGIN_S)
        if thread.is_alive():
            # A backend call is stuck. Its lanes stay held, but no client waits on it any longer.
            log.error("the lane host's scheduler did not stop within %.1f s", grace_s + JOIN_MARGIN_S)
            with self._cond:
                jobs = list(self._alive)
            for job in jobs:
                self._finish(job, CANCELLED, "the server stopped while the engine was busy")
            return False
        return True

    def _drain(self) -> None:
        """Let live streams run until the stop deadline, then end the rest cancelled."""
        while self._lanes.num_busy and not self.broken and time.monotonic() < self._stop_deadline:
            self.step()
        if self.broken:
            return
        try:
            for job in self._lanes.jobs():
                self._end(job, CANCELLED)
        except BackendBroken as error:
            self._latch_broken(str(error))

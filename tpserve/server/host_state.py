"""The lane host's lock and all it guards: the queue, the unfinished jobs, the flags shared by threads.

Clients (submit, cancel, stats) and the scheduling thread meet only here. Every method holds the
lock for a few lines of bookkeeping and none calls the backend, so the lock is never held across a
backend call and clients never wait on the engine. A job is Finished here, once (`finish`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tpserve.server.job_queue import JobQueue
from tpserve.server.lane_job import Job
from tpserve.server.requests import CANCELLED, Finished, HostUnavailable


class HostState:
    def __init__(self, queue_size: int, clock: Callable[[], float]):
        self._clock = clock
        self._cond = threading.Condition()  # guards everything below
        self._queue: JobQueue[Job] = JobQueue(queue_size)
        self._alive: set[Job] = set()  # every job not yet Finished, wherever it is
        self._broken_reason: str | None = None
        self._stopping = False
        self._failure: str | None = None  # set by fail(), latched by the scheduler thread
        self._wake = False
        self._thread: threading.Thread | None = None
        self._num_added = 0  # jobs numbered so far (Job.seq)

    # Read without the lock: each only goes from unset to set, under it.

    @property
    def broken_reason(self) -> str | None:
        return self._broken_reason

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    # ---- clients ----

    def add(self, job: Job, *, queued: bool) -> None:
        """A new job, queued unless it can never run. Raises HostUnavailable or QueueFull."""
        with self._cond:
            if self._broken_reason is not None:
                raise HostUnavailable(f"the engine is broken: {self._broken_reason}")
            if self._stopping:
                raise HostUnavailable("the server is stopping")
            if queued:
                self._queue.push(job, background=job.background)
            self._num_added += 1
            job.seq = self._num_added
            self._alive.add(job)
            self._wake_scheduler()

    def cancel(self, job: Job) -> None:
        """A queued job ends now; one holding a lane is marked for the scheduler to end."""
        with self._cond:
            if job not in self._alive:
                return
            queued = self._queue.remove(job)
            if not queued:
                job.cancel_requested = True  # the scheduler frees its lane at the next boundary
                self._wake_scheduler()
        if queued:
            self.finish(job, CANCELLED)

    def num_queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def finish(self, job: Job, reason: str, error: str | None = None) -> None:
        """Send the job's Finished, unless it already has one."""
        with self._cond:
            if job not in self._alive:
                return
            self._alive.discard(job)
        job.stream.put(Finished(reason, job.usage(self._clock()), error))

    def unfinished(self) -> list[Job]:
        with self._cond:
            return list(self._alive)

    # ---- the scheduler's queue ----

    def peek_many(self, num_jobs: int) -> list[Job]:
        with self._cond:
            return self._queue.peek_many(num_jobs)

    def has_waiting(self) -> bool:
        with self._cond:
            return self._queue.peek() is not None

    def take_head(self, jobs: list[Job]) -> list[Job]:
        """Pop `jobs` (a decision made on an earlier peek_many, outside the lock) while each is still
        next in the queue, in order: the jobs taken. A cancel or a foreground arrival since the peek
        stops the take there; the rest stay queued. The decision is never made here, so nothing of
        the scheduler runs under this lock (STYLE 14)."""
        taken = []
        with self._cond:
            for job in jobs:
                if self._queue.peek() is not job:
                    break
                taken.append(self._queue.pop())
        return taken

    def requeue(self, job: Job) -> bool:
        """A job that gave up its lane (yielded or preempted) goes first in its line. False when it
        was cancelled meanwhile (it is not queued)."""
        with self._cond:
            if job.cancel_requested:
                return False
            self._queue.push_front(job, background=job.background)
            return True

    # ---- the scheduling thread's life ----

    def claim_thread(self, thread: threading.Thread) -> None:
        with self._cond:
            if self._thread is not None or self._stopping:
                raise RuntimeError("the lane host was already started or stopped")
            self._thread = thread

    def next_signals(self) -> tuple[bool, str | None]:
        """Whether the host is stopping, and a failure to latch; clears the wake-up."""
        with self._cond:
            self._wake = False
            return self._stopping, self._failure

    def wait_for_wake(self, timeout_s: float) -> None:
        with self._cond:
            if not (self._wake or self._stopping or self._broken_reason is not None or self._failure):
                self._cond.wait(timeout_s)

    def set_failure(self, reason: str) -> None:
        with self._cond:
            self._failure = reason
            self._wake_scheduler()

    def begin_stop(self) -> tuple[list[Job], threading.Thread | None]:
        """Stop taking work: the queued jobs (removed) and the scheduling thread, if any."""
        with self._cond:
            self._stopping = True
            queued = self._queue.drain()
            self._wake_scheduler()
            return queued, self._thread

    def latch_broken(self, reason: str) -> list[Job] | None:
        """Latch the host broken and empty the queue: the jobs to end. None when already broken."""
        with self._cond:
            if self._broken_reason is not None:
                return None
            self._broken_reason = reason
            self._queue.drain()
            jobs = list(self._alive)
            self._cond.notify_all()
        return jobs

    def _wake_scheduler(self) -> None:
        """Called with the lock held."""
        self._wake = True
        self._cond.notify_all()

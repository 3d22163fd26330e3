"""The lane host's queue of waiting jobs: foreground before background, each in arrival order.

Bounded: a push past `max_size` is refused at once with QueueFull. A job that gave up its lane (a
background job yielding to the foreground, or a stream preempted for KV blocks) goes back to the front
of its line and is never refused, since it was already accepted. Not thread-safe on its own: the lane host calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from tpserve.server.requests import QueueFull

J = TypeVar("J")


class JobQueue(Generic[J]):
    def __init__(self, max_size: int):
        if max_size < 1:
            raise ValueError(f"queue size must be at least 1, got {max_size}")
        self.max_size = max_size
        self._foreground: deque[J] = deque()
        self._background: deque[J] = deque()

    def __len__(self) -> int:
        return len(self._foreground) + len(self._background)

    def push(self, job: J, *, background: bool) -> None:
        if len(self) >= self.max_size:
            raise QueueFull(f"the queue is full ({len(self)} requests waiting)")
        (self._background if background else self._foreground).append(job)

    def push_front(self, job: J, *, background: bool) -> None:
        """Return a job that gave up its lane (yielded or preempted) ahead of every other job of its
        line; never refused, since it was already accepted."""
        (self._background if background else self._foreground).appendleft(job)

    def peek(self) -> J | None:
        """The job that runs next."""
        if self._foreground:
            return self._foreground[0]
        if self._background:
            return self._background[0]
        return None

    def peek_many(self, num_jobs: int) -> list[J]:
        """The next `num_jobs` jobs (or fewer), in the order they would run."""
        jobs = list(self._foreground)[:num_jobs]
        if len(jobs) < num_jobs:
            jobs += list(self._background)[: num_jobs - len(jobs)]
        return jobs

    def pop(self) -> J:
        if self._foreground:
            return self._foreground.popleft()
        if self._background:
            return self._background.popleft()
        raise IndexError("pop from an empty job queue")

    def remove(self, job: J) -> bool:
        """Take `job` out wherever it waits (matched by identity). False when it is not queued."""
        for line in (self._foreground, self._background):
            for index, queued in enumerate(line):
                if queued is job:
                    del line[index]
                    return True
        return False

    def drain(self) -> list[J]:
        """Remove and return every waiting job, in run order."""
        jobs = [*self._foreground, *self._background]
        self._foreground.clear()
        self._background.clear()
        return jobs

"""Which lane holds which job, and the room their reservations take: the scheduler thread's book.

Opening and closing lanes go through here so the book and the backend never disagree. A close that
fails leaves the engine in an unknown state, so it is reported as BackendBroken.
"""

from __future__ import annotations

import itertools

from tpserve.server.backend import Backend, BackendBroken, attempt
from tpserve.server.lane_job import Job


class LaneTable:
    def __init__(self, backend: Backend):
        self._backend = backend
        self.num_lanes = backend.num_lanes
        self._free = list(range(self.num_lanes))
        self._jobs: dict[int, Job] = {}
        self.room_used = 0  # KV tokens reserved by open lanes (read by stats from any thread)
        self._admissions = itertools.count(1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_busy(self) -> int:
        return len(self._jobs)

    def jobs(self) -> list[Job]:
        """Every job holding a lane, in lane order."""
        return [self._jobs[lane] for lane in sorted(self._jobs)]

    def open(self, job: Job) -> bool:
        """Give `job` the lowest free lane with its reservation. False when the backend refuses."""
        if not self._free:
            raise RuntimeError("no free lane to open")
        lane = min(self._free)
        if not self._backend.open(lane, job.reserve):
            return False
        self._free.remove(lane)
        self._jobs[lane] = job
        job.lane = lane
        job.num_prefilled = 0
        job.admitted_seq = next(self._admissions)
        self.room_used += job.reserve
        return True

    def close(self, job: Job) -> None:
        lane = job.lane
        if lane is None or self._jobs.get(lane) is not job:
            raise RuntimeError(f"closing a lane the job does not hold (lane {lane})")
        del self._jobs[lane]
        self._free.append(lane)
        job.lane = None
        self.room_used -= job.reserve
        _, error = attempt(self._backend.close, lane)
        if error is not None:
            raise BackendBroken(f"closing lane {lane} failed: {error!r}") from error

    def forget_all(self) -> None:
        """Drop the book without calling a broken backend (the process is about to exit)."""
        for job in self._jobs.values():
            job.lane = None
        self._jobs.clear()
        self._free = list(range(self.num_lanes))
        self.room_used = 0

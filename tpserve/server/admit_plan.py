"""Admission as part of a step's plan: which waiting jobs the step takes, the lanes they open and the
blocks they book, decided before anything of the step runs (STYLE 14).

`plan_admission` runs the admission loop (admit_choice.py chooses which jobs to take and which
background stream yields its lane for them) on scratch copies: of the lane table and its book
(LaneTable.scratch), of the queue's head (ScratchQueue) and of every job, each lane opened there by
the very code that opens the real one, so the plan and its application cannot drift and nothing
real changes. It returns what happened as plain data, in order: the streams that yield (Yielded)
and each job taken with its lane as it opens (Opening: its table of shared prefix blocks, its cached
length, the blocks its whole prompt books, and whether that prompt rides in the step's pass, goes
in chunks, or waits at the front of its line). The scheduler applies them in order on the real lane
table (lane_scheduler.py), checking that each lane opens as planned.

While streams decode, every whole prompt taken rides in the step's round; with nothing decoding,
the whole prompts of one take are the plan's prompt pass, and admission stops there (a round over
the streams that pass starts needs the tokens it samples: a second message). A long prompt goes in
chunks, one at a time; a job taken as short that turns out long while another chunks (the prefix
it counted on went meanwhile) waits for that one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.server.admit_choice import AdmitChoice
from tpserve.server.lane_job import Job
from tpserve.server.lane_table import LaneTable


@dataclass(frozen=True)
class Yielded:
    """The background stream on `lane` gives up its lane (back to the front of the background line)
    for the foreground jobs waiting."""

    lane: int


@dataclass(frozen=True)
class Opening:
    """The job next in the queue (Job.seq `job`) is taken and opens `lane` with `blocks` (the shared
    blocks of its cached prefix, and the block a partial match copies into), its first `num_cached`
    positions cached. `rides`: its whole prompt then books `booked` and goes in the step's pass;
    `chunks`: its long prompt goes in chunks from this step on; neither: it waits (its blocks are not
    free, or another prompt chunks), its lane closed again and itself back at the front of its line."""

    job: int
    lane: int
    blocks: tuple[int, ...]
    num_cached: int
    booked: tuple[int, ...] = ()
    rides: bool = False
    chunks: bool = False


AdmitStep = Yielded | Opening


class ScratchBackend:
    """What a scratch lane table calls when lanes open and close: nothing runs."""

    def open(self, lane: int, blocks: tuple[int, ...], num_cached: int, copy_from: int = -1) -> None:
        pass

    def close(self, lane: int) -> None:
        pass


class ScratchQueue:
    """The queue's head as the scheduler uses it (peek, take, requeue), over copies of its jobs.
    `head` holds more jobs than one step can take (a lane each) and one admission peeks (16): the
    jobs behind it cannot change what the plan sees."""

    def __init__(self, head: list[Job]):
        self._lines = ([job for job in head if not job.background], [job for job in head if job.background])

    def _jobs(self) -> list[Job]:
        return self._lines[0] + self._lines[1]

    def peek_many(self, num_jobs: int) -> list[Job]:
        return self._jobs()[:num_jobs]

    def has_waiting(self) -> bool:
        return bool(self._jobs())

    def take_head(self, jobs: list[Job]) -> list[Job]:
        taken = []
        for job in jobs:
            if self._jobs()[:1] != [job]:
                break
            self._lines[job.background].remove(job)
            taken.append(job)
        return taken

    def requeue(self, job: Job) -> bool:
        if job.cancel_requested:
            return False
        self._lines[job.background].insert(0, job)
        return True


class _Admitting:
    """One plan's admission on scratch copies: the chunking job and the riding prompts as they
    become, and what happened, in order."""

    def __init__(self, lanes: LaneTable, queue: ScratchQueue, admission, chunking: Job | None, riding):
        self.lanes = lanes
        self.queue = queue
        self.choice = AdmitChoice(lanes, admission.max_prefill_tokens)
        self.admission = admission
        self.chunking = chunking
        self.riding = list(riding)
        self.steps: list[AdmitStep] = []

    def run(self) -> None:
        """Admission's loop: yield a lane, or take the jobs the choice takes, until nothing more."""
        budget = None  # None: nothing taken yet this step
        for _ in range(self.admission.max_iterations):
            waiting = self.queue.peek_many(self.admission.max_joint_prompts)
            victim = self.choice.yielding_stream(waiting, self.chunking)
            if victim is not None:
                self.steps.append(Yielded(victim.lane))
                self._give_up_lane(victim)
                continue
            beside = self.choice.decodes(self.chunking, self.riding)
            jobs, budget = self._take(budget, self.admission.max_joint_prompts - len(self.riding))
            if not jobs:
                return
            for job in jobs:
                self._open(job)
            if self.riding and not beside:
                return  # the plan's prompt pass is this step's

    def _take(self, budget: int | None, most: int) -> tuple[list[Job], int | None]:
        """The head jobs the choice takes (at most `most`), with the step's prompt budget left."""
        num_free = self.lanes.num_free
        if most < 1 or not self.choice.can_take(num_free, budget) or not self.queue.has_waiting():
            return [], budget
        head = self.queue.peek_many(min(most, num_free))
        free_blocks = self.lanes.blocks.num_free - self.choice.blocks_wanted(self.chunking)
        num_taken, left = self.choice.num_to_take(head, free_blocks, budget, self.chunking, self.riding)
        return self.queue.take_head(head[:num_taken]), left

    def _open(self, job: Job) -> None:
        """Set the job up: a lane on the shared blocks of its cached prefix, then its whole prompt's
        blocks (it rides), or chunks, or it waits."""
        self.lanes.open(job, 0)
        opened = (job.seq, job.lane, tuple(job.blocks), job.cached_tokens)
        if not self.admission.needs_chunks(job):
            if self.lanes.cover(job, len(job.feed_ids)):
                self.steps.append(Opening(*opened, tuple(job.blocks[len(opened[2]) :]), rides=True))
                self.riding.append(job)
                return
        elif self.chunking is None:
            self.steps.append(Opening(*opened, chunks=True))
            self.chunking = job
            return
        self.steps.append(Opening(*opened))
        self._give_up_lane(job)

    def _give_up_lane(self, job: Job) -> None:
        if job is self.chunking:
            self.chunking = None
        self.riding = [ride for ride in self.riding if ride is not job]
        self.lanes.close(job)
        self.queue.requeue(job)


def plan_admission(
    lanes: LaneTable, queue: ScratchQueue, admission, chunking: Job | None, riding: list[Job]
) -> tuple[tuple[AdmitStep, ...], Job | None, list[Job]]:
    """This step's admission, run on scratch copies (`lanes` from LaneTable.scratch, `queue`, and
    `chunking` and `riding` among the copies; all are changed): what happened, in order, and the
    chunking job and the riding prompts after it. `admission`: the Admission whose figures bound it
    (max_joint_prompts, max_iterations, max_prefill_tokens, needs_chunks)."""
    admitting = _Admitting(lanes, queue, admission, chunking, riding)
    admitting.run()
    return tuple(admitting.steps), admitting.chunking, admitting.riding

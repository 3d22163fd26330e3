"""Which waiting jobs admission takes, and which background stream yields its lane for them.

Reads only. A job is taken when its first pass's KV blocks are free; a step prefills at most
`max_prefill_tokens` prompt tokens of whole prompts (its first pass always goes), so a burst delays
the live streams' next decode round by about one pass. Whether a prompt needs chunks, and how much
of the budget it takes, is judged at take time by the prefix its shared blocks would supply, so a
mostly cached prompt can join a joint pass; one long prompt chunks at a time.

A foreground job that cannot get a lane or room makes the newest background stream yield its lane;
the yielded job goes back to the front of the background line and later re-prefills its prompt and
the tokens it already produced, so position-keyed sampling continues exactly where it left off.
A step's plan asks it, on scratch copies (tpserve/server/admit_plan.py); taking and opening are the
scheduler's, applying that plan (tpserve/server/lane_scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from tpserve.server.lane_job import Job
from tpserve.server.lane_table import LaneTable


class AdmitChoice:
    def __init__(self, lanes: LaneTable, max_prefill_tokens: int):
        self._lanes = lanes
        self._max_prefill_tokens = max_prefill_tokens

    def _expected_new_tokens(self, job: Job) -> int:
        """Before setup: the prompt tokens left past the prefix shared blocks would supply now."""
        return len(job.feed_ids) - self._lanes.cached_prefix(job)[0]

    def _expects_chunks(self, job: Job) -> bool:
        """Before setup: `_needs_chunks`, counting the prefix the prompt cache would restore now."""
        return self._expected_new_tokens(job) > self._max_prefill_tokens

    def can_take(self, num_free: int, budget: int | None) -> bool:
        """Whether a take is worth asking the book's free blocks for (the queue holds a job)."""
        return num_free > 0 and (budget is None or budget > 0)

    def first_pass_blocks(self, job: Job) -> int:
        """Before setup: the free blocks the job's lane takes for its first pass (the unreferenced
        shared blocks of its cached prefix, then one pass's worth of its prompt); later blocks come
        as it grows."""
        hit, num_idle = self._lanes.cached_prefix(job)
        new_tokens = len(job.feed_ids) - hit
        # A prompt that goes in one pass counts the position its first decode round writes too.
        end = (
            len(job.feed_ids) + 1
            if new_tokens <= self._max_prefill_tokens
            else job.chunk_end(hit, self._max_prefill_tokens)
        )
        blocks = self._lanes.blocks
        return blocks.blocks_for(end) - hit // blocks.block_size + num_idle

    def num_to_take(
        self, head: Sequence[Job], free_blocks: int, budget: int | None, chunking: Job | None, riding=()
    ) -> tuple[int, int]:
        """How many of the queue's head jobs to take: one, or several for one joint pass, only what
        fits in `head` (as many as lanes are free), `free_blocks` (each job's first pass) and `budget`
        (prompt tokens this step may still prefill; None: the step's first pass, which takes at
        least one job and at most one pass's worth). Returns that number and the budget left after
        them (a long prompt's chunks are not counted: they go one a step). No long prompt is taken
        while `chunking`. A job whose blocks are not free waits, and the jobs behind it; so does one
        whose next uncached prefix block `chunking`, `riding` (this step's round) or a job taken
        before it computes: it shares that block once computed."""
        num_tokens = num_taken = 0
        limit = self._max_prefill_tokens if budget is None else budget
        computing = [*([chunking] if chunking is not None else []), *riding]
        for job in head:
            needed = self.first_pass_blocks(job)
            if needed > free_blocks or self._lanes.shares_uncomputed(job, computing):
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
            computing.append(job)
            free_blocks -= needed
            if long:
                break
        return num_taken, limit - num_tokens

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
        free_blocks = self._lanes.blocks.num_free
        spare_lanes = num_free + len(background)
        spare_blocks = free_blocks + sum(len(job.blocks) for job in background)
        num_wanted = wanted_blocks = 0
        for job in waiting:
            needed = self.first_pass_blocks(job)
            if num_wanted == spare_lanes or wanted_blocks + needed > spare_blocks:
                break
            num_wanted += 1
            wanted_blocks += needed
        if num_wanted == 0 or (num_free >= num_wanted and free_blocks >= wanted_blocks):
            return None
        return max(background, key=lambda job: job.admitted_seq)

    def decodes(self, chunking: Job | None, riding: list[Job]) -> bool:
        """Whether a stream decodes this step (not the chunking job, nor the whole prompts `riding`
        in this step's round): then whole prompts taken now ride in its round's pass."""
        return any(job.produced and job is not chunking and job not in riding for job in self._lanes.jobs())

    def blocks_wanted(self, chunking: Job | None) -> int:
        """Blocks the streams holding lanes want by the end of this step (each decoding stream's next
        position, the chunking job's next chunk): admission leaves them free, so taking a job never
        makes a live stream wait or be preempted at once."""
        wanted = sum(
            self._lanes.blocks_missing(job, job.next_position + 1)
            for job in self._lanes.jobs()
            if job is not chunking and job.produced
        )
        if chunking is not None:
            end = chunking.chunk_end(chunking.num_prefilled, self._max_prefill_tokens)
            wanted += self._lanes.blocks_missing(chunking, end)
        return wanted

"""A step's plan: what one forward pass does, decided before anything of it runs (STYLE 14).

`plan_round` reads the lane table, the KV book and the scheduler's notes (which job chunks, which
prompts ride) and returns a StepPlan of plain data: the streams that end or are preempted first,
each decoding stream's rows (its token and draft tokens) with the block-table entries its pass
appends, the prompts beside them (the long prompt's next chunk, then the whole prompts admitted this
step), and every block the plan books, in the order the book hands them out. It changes nothing and
calls nothing on the engine, so the same state gives the same plan; the scheduler then applies the
plan (closes, books, one pass) and applies the sampled tokens (`update_from_output`), one way.

Block ids are chosen here, as the book would hand them out after the plan's closes: the book gives
the lowest free ids first, then the least recently released cached blocks, and `_Pool` replays the
closes on a tally without touching the book. Applying the plan books exactly these ids or raises.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tpserve.server.admit_plan import AdmitStep
from tpserve.server.kv_blocks import KVBlocks
from tpserve.server.lane_job import Job
from tpserve.server.lane_table import LaneTable


@dataclass(frozen=True)
class StreamRows:
    """A decoding stream's rows this step: `token_id` fed at `position`, then `draft` after it."""

    lane: int
    position: int
    token_id: int
    draft: tuple[int, ...]
    blocks: tuple[int, ...]  # block-table entries this pass appends (booked earlier or by this plan)
    num_booked: int  # how many of the last of `blocks` this plan books from the pool


@dataclass(frozen=True)
class PromptRows:
    """A prompt's tokens this step: feed_ids[start:start+num_tokens] of the lane's stream; `last`
    when they end the prompt (its first token is sampled in this pass)."""

    lane: int
    start: int
    num_tokens: int
    last: bool
    blocks: tuple[int, ...]
    num_booked: int


@dataclass(frozen=True)
class StepPlan:
    """One step, in the order it is applied: `finished` (cancelled streams) end, `admitted`: the
    waiting jobs taken, each opening its lane and booking its prompt's blocks, and the background
    streams that yield for them (admit_plan.py), `preempted` streams give up their lanes (back to
    the queue, recomputed later), `booked` blocks leave the pool, then one pass over `rows` and
    `prompts` (a chunk first, then whole prompts). No rows: nothing decodes this step, and the
    prompts go in a pass of their own: the whole prompts (the `joint` ones together, any other
    alone), or else the long prompt's chunk."""

    finished: tuple[int, ...] = ()  # lanes
    preempted: tuple[int, ...] = ()  # lanes, in the order they give them up
    rows: tuple[StreamRows, ...] = ()
    prompts: tuple[PromptRows, ...] = ()
    booked: tuple[int, ...] = ()  # block ids, in the order the book hands them out
    # With no rows: the lanes of the whole prompts that go in one joint pass (two or more, all or
    # none: refused, each goes alone); the other prompts go alone.
    joint: tuple[int, ...] = ()
    admitted: tuple[AdmitStep, ...] = ()  # in the order they are applied, after `finished`

    @property
    def num_rows(self) -> int:
        """The decode round's rows: one per stream and one per draft token."""
        return sum(1 + len(rows.draft) for rows in self.rows)


class _Pool:
    """The book's free blocks as the plan sees them: closes release, covers take, the book itself is
    never touched. Every release comes before the first take (the plan closes, then books)."""

    def __init__(self, blocks: KVBlocks):
        self._blocks = blocks
        self._dropped: Counter[int] = Counter()  # references the plan's closes drop, per block
        self._plain: list[int] = []  # blocks the closes leave unreferenced, uncached, in order
        self._cached: list[int] = []  # and cached ones (they stay findable), in order
        self._num_taken = 0

    @property
    def num_free(self) -> int:
        return self._blocks.num_free + len(self._plain) + len(self._cached) - self._num_taken

    def release(self, table: Sequence[int]) -> None:
        """A lane holding `table` closes."""
        if self._num_taken:
            raise RuntimeError("a plan released blocks after it took some")
        for block in table:
            self._dropped[block] += 1
            if self._dropped[block] == self._blocks.num_refs(block):
                (self._cached if self._blocks.is_cached(block) else self._plain).append(block)

    def take(self, num_blocks: int) -> bool:
        """Take `num_blocks` more; False (nothing taken) when too few are free."""
        if num_blocks > self.num_free:
            return False
        self._num_taken += num_blocks
        return True

    def booked(self) -> tuple[int, ...]:
        """The ids of every block taken, in the order the book will hand them out."""
        return self._blocks.peek(self._num_taken, self._plain, self._cached)


def _newest(jobs: list[Job]) -> Job:
    """The stream preempted first: background before foreground, then the last admitted."""
    return max(jobs, key=lambda job: (job.background, job.admitted_seq))


def plan_round(
    lanes: LaneTable,
    chunking: Job | None,
    riding: Sequence[Job],
    drafts_for: Callable[[list[Job]], list[tuple[int, ...]]] | None,
    chunk_size: Callable[[int], int],
    joint_prompts: Callable[[list[Job]], list[Job]],
) -> StepPlan:
    """The plan of this step's decode round: every live stream's rows, with the long prompt's next
    chunk (sized by `chunk_size(round rows)`) and the riding whole prompts in the same pass; with
    no stream decoding, those prompts in passes of their own (`joint_prompts` chooses which go
    together, `chunk_size(0)` sizes the chunk). When too few blocks are free for every decoding
    stream's next position, streams are preempted, the newest first, until the rest fit (a stream
    that needs a block never fails, it waits in the queue). Drafts (`drafts_for`, which reads only)
    never preempt: they are cut to the blocks a stream holds or can have. Reads only: nothing in
    the lane table, the book or the jobs changes."""
    size = lanes.blocks.block_size
    jobs = lanes.jobs()
    finished = [job for job in jobs if job.cancel_requested]
    riding = [job for job in riding if job not in finished]
    chunking = None if chunking in finished else chunking
    live = [job for job in jobs if job not in finished and job is not chunking and job not in riding]
    holders = [*live, *riding, *([chunking] if chunking is not None else [])]
    pool = _Pool(lanes.blocks)
    for job in finished:
        pool.release(job.blocks)
    preempted = []
    while holders:
        wanted = sum(lanes.blocks_missing(job, job.next_position + 1) for job in live)
        if wanted <= pool.num_free:
            break
        victim = _newest(holders)
        holders.remove(victim)
        preempted.append(victim)
        pool.release(victim.blocks)
        if victim in live:
            live.remove(victim)
    riding = [job for job in riding if job not in preempted]
    chunking = None if chunking in preempted else chunking
    if not live:
        return _prompts_alone(
            lanes, finished, preempted, riding, chunking, pool, chunk_size(0), joint_prompts
        )
    # Blocks leave the pool in this order: each stream's next position, the chunk, the drafts.
    num_for_token = [lanes.blocks_missing(job, job.next_position + 1) for job in live]
    pool.take(sum(num_for_token))
    drafts = drafts_for(live) if drafts_for is not None else [()] * len(live)
    chunk = None  # (start, num_tokens, blocks it books)
    if chunking is not None:
        chunk = _next_chunk(lanes, chunking, chunk_size(sum(1 + len(d) for d in drafts)))
        chunk = chunk if pool.take(chunk[2]) else None  # else it waits a step
    num_for_draft = []
    for index, (job, num) in enumerate(zip(live, num_for_token)):
        draft, held = drafts[index], len(job.blocks) + num
        missing = max(0, lanes.blocks.blocks_for(job.next_position + 1 + len(draft)) - held)
        if draft and not pool.take(missing):
            draft, missing = draft[: held * size - job.next_position - 1], 0
        drafts[index] = tuple(draft)
        num_for_draft.append(missing if draft else 0)
    booked = pool.booked()
    ids = iter(booked)
    token_ids = [tuple(itertools.islice(ids, num)) for num in num_for_token]
    chunk_ids = tuple(itertools.islice(ids, chunk[2])) if chunk is not None else ()
    rows = []
    for job, draft, first, num in zip(live, drafts, token_ids, num_for_draft):
        new = first + tuple(itertools.islice(ids, num))
        rows.append(
            StreamRows(job.lane, job.next_position, job.produced[-1], draft, _unsent(job) + new, len(new))
        )
    prompts = [] if chunk is None else [_chunk_rows(chunking, chunk, chunk_ids)]
    prompts += _riding_rows(riding)
    return StepPlan(
        tuple(job.lane for job in finished),
        tuple(job.lane for job in preempted),
        tuple(rows),
        tuple(prompts),
        booked,
    )


def _prompts_alone(lanes, finished, preempted, riding, chunking, pool, max_chunk, joint_prompts) -> StepPlan:
    """The plan of a step in which nothing decodes: the riding whole prompts (their streams decoded
    when they were taken, and have ended or been preempted since), else the chunk. Not both: a
    chunk is never part of a joint pass of whole prompts, and a step runs one pass, so the chunk
    waits a step."""
    prompts = _riding_rows(riding)
    booked = ()
    if chunking is not None and not riding:
        chunk = _next_chunk(lanes, chunking, max_chunk)
        if pool.take(chunk[2]):  # else it waits a step for its blocks
            booked = pool.booked()
            prompts.append(_chunk_rows(chunking, chunk, booked))
    return StepPlan(
        tuple(job.lane for job in finished),
        tuple(job.lane for job in preempted),
        (),
        tuple(prompts),
        booked,
        tuple(job.lane for job in joint_prompts(list(riding))),
    )


def _next_chunk(lanes: LaneTable, chunking: Job, max_tokens: int) -> tuple[int, int, int]:
    """The long prompt's next chunk of at most `max_tokens`: (start, tokens, blocks it must book)."""
    start = chunking.num_prefilled
    num_tokens = chunking.chunk_end(start, max_tokens) - start  # (no image cut: Job.chunk_end)
    return start, num_tokens, lanes.blocks_missing(chunking, start + num_tokens)


def _chunk_rows(chunking: Job, chunk: tuple[int, int, int], booked: tuple[int, ...]) -> PromptRows:
    start, num_tokens, _ = chunk
    last = start + num_tokens == len(chunking.feed_ids)
    return PromptRows(chunking.lane, start, num_tokens, last, _unsent(chunking) + booked, len(booked))


def _riding_rows(riding: Sequence[Job]) -> list[PromptRows]:
    """The whole prompts admitted this step, each from its cached tokens on (their blocks were
    booked when they were admitted)."""
    return [
        PromptRows(job.lane, job.cached_tokens, len(job.feed_ids) - job.cached_tokens, True, _unsent(job), 0)
        for job in riding
    ]


def _unsent(job: Job) -> tuple[int, ...]:
    """The job's booked blocks its backend table does not hold yet (they go with its next pass)."""
    return tuple(job.blocks[job.num_blocks_sent :])

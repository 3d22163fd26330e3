"""Every lane's block table and how many tables hold each KV block: the bookkeeping every rank keeps alike.

Rank 0's lane host fills the tables (tpserve/server/kv_blocks.py) and sends them with the passes, so
no rank allocates: these tables only check that what they are given is sound (blocks in the pool, a
block a lane writes held by no other lane, each span at its lane's length) and record it. A lane may
open on the blocks of a cached prefix that other lanes hold too (read only); every block it writes is
its own. The Engine (tpserve/ranks/engine.py) is these tables with the KV pool and the passes.
"""

from __future__ import annotations

from dataclasses import dataclass


class EngineError(RuntimeError):
    """A call the engine refuses (bad lane, position or size): the host sent something inconsistent."""


@dataclass
class Lane:
    blocks: list[int]  # the block table: block ids holding positions 0, 1, ... in order
    length: int = 0  # tokens whose KV is computed (positions 0..length-1)
    drafts_from: int = 0  # after a Verify: where its drafts begin (a later round may drop them); 0: none
    rope_delta: int = (
        0  # multimodal rotary: a token's (t, h, w) past its prompt's rope (tpserve/ranks/mrope.py)
    )
    passed: bool = False  # a pass has written its KV: its prompt's first pass, the one voted on, is done


class LaneTables:
    """`num_blocks`: the blocks lanes may hold (ids 0..num_blocks-1); `block_size`: positions per block."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.lanes: dict[int, Lane] = {}
        self.refs: dict[int, int] = {}  # block id -> how many lanes' tables hold it

    def check_open(
        self, lane: int, blocks: tuple[int, ...], num_cached: int, copy_from: int
    ) -> tuple[int, int]:
        """Raise EngineError unless `lane` may open on `blocks` with `num_cached` positions computed
        (Engine.admit says how); else (shared blocks, slots to copy from `copy_from`)."""
        num_shared, num_copied = divmod(num_cached, self.block_size)
        if lane in self.lanes or num_shared + bool(num_copied) > len(blocks):
            raise EngineError(
                f"lane {lane}: cannot open on {len(blocks)} blocks with {num_cached} cached tokens"
            )
        if num_copied and not 0 <= copy_from < self.num_blocks or not num_copied and copy_from != -1:
            raise EngineError(
                f"lane {lane}: {num_copied} cached slots (of {num_cached}) to copy from KV block {copy_from}"
            )
        if any(not 0 <= block < self.num_blocks for block in blocks[:num_shared]):
            raise EngineError(f"lane {lane} given a shared KV block outside the pool: {list(blocks)}")
        self._check_own(lane, blocks[num_shared:])
        return num_shared, num_copied

    def open(self, lane: int, blocks: tuple[int, ...], num_cached: int) -> None:
        """Record `lane` open on `blocks` (check_open passed), its first `num_cached` positions computed."""
        self.lanes[lane] = Lane([], num_cached)
        self._append(lane, blocks)

    def release(self, lane: int) -> None:
        state = self.lanes.pop(lane, None)
        if state is not None:
            for block in state.blocks:
                if self.refs[block] == 1:
                    del self.refs[block]
                else:
                    self.refs[block] -= 1

    def _check_own(self, lane: int, blocks) -> None:
        """Blocks a lane will write: in the pool, held by no lane, each once."""
        for block in blocks:
            if not 0 <= block < self.num_blocks or block in self.refs:
                raise EngineError(
                    f"lane {lane} given KV block {block} to write: outside the pool of "
                    f"{self.num_blocks} or held by {self.refs.get(block)} lane(s)"
                )
        if len(set(blocks)) != len(blocks):
            raise EngineError(f"lane {lane} given a KV block twice: {list(blocks)}")

    def _append(self, lane: int, blocks) -> None:
        for block in blocks:
            self.refs[block] = self.refs.get(block, 0) + 1
        self.lanes[lane].blocks.extend(blocks)

    def _grow(self, spans) -> None:
        """Append each span's new blocks to its lane's table (spans passed check())."""
        for lane, _, _, blocks in spans:
            self._append(lane, blocks)

    @staticmethod
    def _spans(spans) -> list:
        """Spans as (lane, start, token ids, new blocks); a span of three has no new blocks."""
        return [span if len(span) == 4 else (*span, ()) for span in spans]

    def check(self, spans) -> bool:
        """Whether forward(spans) would be accepted: open lanes, each span at its lane's length, its
        positions inside the lane's blocks with the span's new ones, sound new blocks, no lane twice,
        and no write into a block another lane holds. spans: (lane, start, token ids, new blocks)."""
        seen, given, size = set(), set(), self.block_size
        for lane, start, tokens, blocks in self._spans(spans):
            state = self.lanes.get(lane)
            if state is None or lane in seen or not tokens or start != state.length:
                return False
            table = state.blocks + list(blocks)
            if start + len(tokens) > len(table) * size:
                return False
            if any(not 0 <= b < self.num_blocks or b in self.refs or b in given for b in blocks):
                return False
            written = table[start // size : -(-(start + len(tokens)) // size)]
            if any(self.refs.get(b, 0) > 1 for b in written):
                return False
            given.update(blocks)
            seen.add(lane)
        return True

    def first_pass(self, spans) -> bool:
        """Whether any span is its lane's first pass (a prompt's first chunk, or the whole prompt):
        only such a pass is voted on (tpserve/ranks/apply.py). A later chunk or a decode step rides on what
        every rank already holds, sound by construction, so it costs no vote. A lane not open counts
        as first, so check() refuses it by vote."""
        return any(lane not in self.lanes or not self.lanes[lane].passed for lane, *_ in spans)

    def drop_unkept_drafts(self, spans) -> None:
        """Cut lanes a Verify left longer than a span's start back to it (idempotent).
        Only the drafts a Verify fed may be dropped: a span anywhere else fails check()."""
        for lane, start, *_ in spans:
            state = self.lanes.get(lane)
            if state is not None and state.drafts_from and state.drafts_from <= start < state.length:
                state.length = start

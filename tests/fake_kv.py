"""The fake backend's KV, modelled in blocks as the engine holds it: each lane has a block table,
every fed token is written into its block's slot and the lane's history is read back through the
table, so a block handed to two lanes, reused while held, or missing from a table changes the reply
or is refused as misuse, as the engine refuses it (tests/fake_backend.py runs the passes over it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class FakeMisuse(AssertionError):
    """The host broke the Backend contract. Recorded in `misuse` too, since the host may catch it."""


@dataclass
class FakeLane:
    table: list[int]  # block ids holding positions 0, 1, ... in order
    length: int = 0  # positions fed so far (their tokens live in the table's blocks)
    pending: int | None = None  # the last sampled token, fed next at position `length`
    num_samples: int = 0
    features: list[tuple[int, float]] = field(default_factory=list)
    draft_features: list[list[tuple[int, float]]] = field(default_factory=list)  # per row of a Verify


class FakeKV:
    """The lanes' block tables, the token in each written slot, each block's holders, and the misuse noted."""

    def __init__(self, *, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.lanes: dict[int, FakeLane] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> the token written there
        self.refs: dict[int, int] = {}  # block -> how many lanes' tables hold it
        self.misuse: list[str] = []

    def assert_clean(self) -> None:
        """Everything the host held is returned and it never broke the contract."""
        assert self.misuse == [], self.misuse
        assert self.lanes == {}, f"lanes still open: {sorted(self.lanes)}"
        assert self.refs == {}, f"blocks still held: {sorted(self.refs)}"

    def _misuse(self, message: str) -> None:
        self.misuse.append(message)
        raise FakeMisuse(message)

    def _open_lane(self, lane: int) -> FakeLane:
        if lane not in self.lanes:
            self._misuse(f"lane {lane} is not open")
        return self.lanes[lane]

    def _share(self, lane: int, blocks: Sequence[int]) -> None:
        """Start the lane's table with shared blocks, each holding a whole cached prefix block."""
        for block in blocks:
            if not 0 <= block < self.num_blocks or any(
                (block, offset) not in self.slots for offset in range(self.block_size)
            ):
                self._misuse(f"lane {lane} shares block {block}, which holds no whole prefix")
            self.refs[block] = self.refs.get(block, 0) + 1
            self.lanes[lane].table.append(block)

    def _copy_slots(self, lane: int, source: int, target: int, num_slots: int) -> None:
        if target in self.refs or any((source, offset) not in self.slots for offset in range(num_slots)):
            self._misuse(f"lane {lane} copies {num_slots} uncomputed slots of block {source} into {target}")
            return
        for offset in range(num_slots):
            self.slots[(target, offset)] = self.slots[(source, offset)]

    def _release(self, lane: int) -> None:
        """Drop the lane and its table's hold on each block."""
        for block in self.lanes.pop(lane).table:
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]

    def _extend(self, lane: int, blocks: Sequence[int]) -> None:
        """Append blocks to the lane's table: refused, as the engine refuses, when a block is out of
        the pool or another table holds it."""
        for block in blocks:
            if not 0 <= block < self.num_blocks or block in self.refs:
                self._misuse(f"lane {lane} given block {block} to write, out of the pool or held")
            self.refs[block] = 1
            self.lanes[lane].table.append(block)

    def _unextend(self, lane: int, blocks: Sequence[int]) -> None:
        table = self.lanes[lane].table
        for block in reversed(blocks):
            if table and table[-1] == block:
                table.pop()
                del self.refs[block]

    def _first_token_of(self, lane: FakeLane, item) -> int:
        """The first token of the prompt `item` (a PrefillItem) feeds on `lane`, or has fed."""
        return self._history(lane)[0] if lane.length else item.token_ids[0]

    def _history(self, lane: FakeLane) -> list[int]:
        """The tokens at the lane's positions, read back through its block table."""
        size = self.block_size
        return [self.slots[(lane.table[p // size], p % size)] for p in range(lane.length)]

    @staticmethod
    def _reset(lane: FakeLane) -> None:
        lane.length = 0
        lane.pending = None
        lane.num_samples = 0
        lane.features = []

    @classmethod
    def _rewind(cls, lane: FakeLane, length: int) -> None:
        cls._reset(lane)
        lane.length = length

    def _feed(self, lane: FakeLane, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            position = lane.length
            if position // self.block_size >= len(lane.table):
                self._misuse(f"a lane wrote position {position} past its blocks ({len(lane.table)} blocks)")
            block = lane.table[position // self.block_size]
            if self.refs[block] > 1:
                self._misuse(f"a lane wrote position {position} into block {block}, which another lane holds")
            self.slots[(block, position % self.block_size)] = token
            lane.length += 1

"""The wire's messages: rank 0's decisions as typed, frozen dataclasses, one per kind.

Each kind carries a KIND number and a few ints (or the spans and steps of tpserve/ranks/wire_spans.py);
tpserve/ranks/wire.py encodes them to the int64 tensors a broadcast carries, and back. A scheduling
step travels as one StepPlan: Admit, Release, Prefill, Round and Verify are its parts (rank 0 applies
an Admit or a Release alone as it makes it, and sends it in the next plan); Idle and Stop go between
steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tpserve.ranks.wire_spans import Span, Step

__all__ = [
    "KINDS",
    "LANE_CHANGES",
    "Admit",
    "Idle",
    "Message",
    "Prefill",
    "Release",
    "Round",
    "StepPlan",
    "Stop",
    "Verify",
]


# One frozen dataclass per kind, each spelled out (STYLE 3): that they look alike is the wire's
# shape (a KIND and a few ints), not logic written twice.


@dataclass(frozen=True)
class Admit:
    """Open `lane` with `blocks` as its block table, its first `num_cached` positions a shared cached
    prefix already in those blocks (rank 0's lane host chose them: every rank's tables are the same by
    construction, so nothing is voted). When `num_cached` ends inside a block, that block is the
    lane's own and its first `num_cached % block_size` slots are copied from block `copy_from`,
    which holds the same tokens after the same prefix (a partial match: the same bits a prefill
    would write)."""

    KIND: ClassVar[int] = 1
    lane: int
    blocks: tuple[int, ...] = ()
    num_cached: int = 0
    copy_from: int = -1

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(self.blocks))


@dataclass(frozen=True)
class Prefill:
    """One packed prefill pass over one or several streams (voted on when it holds a prompt's first
    pass, tpserve/ranks/apply.py)."""

    KIND: ClassVar[int] = 2
    spans: tuple[Span, ...]

    def __post_init__(self):
        object.__setattr__(self, "spans", tuple(self.spans))


@dataclass(frozen=True)
class Round:
    """One decode step over the live lanes (each lane first cut back to its step's position)."""

    KIND: ClassVar[int] = 3
    steps: tuple[Step, ...]

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple(self.steps))


@dataclass(frozen=True)
class Verify:
    """A decode round with draft tokens: each span feeds its lane's last sampled token and its drafts,
    and every row's logits come back. Like a Round, it first cuts each lane back to the span's start,
    dropping the drafts an earlier Verify fed and the host did not accept."""

    KIND: ClassVar[int] = 10
    spans: tuple[Span, ...]

    def __post_init__(self):
        object.__setattr__(self, "spans", tuple(self.spans))


@dataclass(frozen=True)
class Release:
    """Drop the lane and its block table."""

    KIND: ClassVar[int] = 4
    lane: int


@dataclass(frozen=True)
class Idle:
    """Rank 0 is going idle: followers wait on the doorbell, not in a collective, before the next."""

    KIND: ClassVar[int] = 8


@dataclass(frozen=True)
class Stop:
    """Followers leave their loop and exit 0."""

    KIND: ClassVar[int] = 9


@dataclass(frozen=True)
class StepPlan:
    """One scheduling step as every rank applies it, in order: the lanes rank 0 opened and closed
    since its last message (`lanes`: opening or closing a lane costs the wire nothing of its own),
    then at most one forward pass: a decode round (`round`, a Round or a Verify), prompts
    (`prefill`: whole prompts admitted this step, a long prompt's next chunk), or both in one pass.
    A step is one message, one pass and at most one vote, taken when a prompt starts in the pass,
    after every rank checked the whole pass and before its collectives (tpserve/ranks/apply.py). A
    plan with no pass carries only the lanes closed just before a Stop."""

    KIND: ClassVar[int] = 13
    lanes: tuple[Admit | Release, ...] = ()
    round: Round | Verify | None = None
    prefill: Prefill | None = None

    def __post_init__(self):
        object.__setattr__(self, "lanes", tuple(self.lanes))

    @property
    def parts(self) -> tuple:
        """What the plan carries, in the order it is applied: the lanes, the round, the prompts."""
        return (*self.lanes, *(part for part in (self.round, self.prefill) if part is not None))

    @property
    def runs_pass(self) -> bool:
        return self.round is not None or self.prefill is not None


Message = Admit | Prefill | Round | Verify | Release | Idle | Stop | StepPlan
KINDS: dict[int, type] = {
    cls.KIND: cls for cls in (Admit, Prefill, Round, Verify, Release, Idle, Stop, StepPlan)
}
LANE_CHANGES = (Admit, Release)  # what a StepPlan carries before its pass

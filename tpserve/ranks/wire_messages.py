"""The wire's messages: rank 0's decisions as typed, frozen dataclasses, one per kind.

Each kind carries a KIND number and a few ints (or the spans and steps of tpserve/ranks/wire_spans.py);
tpserve/ranks/wire.py encodes them to the int64 tensors a broadcast carries, and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tpserve.ranks.wire_spans import Span, Step

__all__ = [
    "BUNDLED",
    "KINDS",
    "Admit",
    "Bundle",
    "Idle",
    "Message",
    "Mixed",
    "Prefill",
    "Release",
    "Round",
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
class Mixed:
    """A decode round (a Round or a Verify) and prompts (a Prefill: whole prompts admitted this step,
    a long prompt's next chunk) in one forward pass (voted on first when a prompt starts in it, as a
    Prefill): a step is one message, one pass and at most one vote."""

    KIND: ClassVar[int] = 12
    round: Round | Verify
    prefill: Prefill


@dataclass(frozen=True)
class Bundle:
    """Several messages in one broadcast, applied in order: the lanes rank 0 opened and closed since
    its last message, then the pass that uses them. Opening or closing a lane so costs the wire
    nothing of its own; rank 0 applied those at once, the followers apply them before the pass."""

    KIND: ClassVar[int] = 11
    messages: tuple[Admit | Release | Prefill | Round | Verify | Mixed, ...]

    def __post_init__(self):
        object.__setattr__(self, "messages", tuple(self.messages))


Message = Admit | Prefill | Round | Verify | Release | Idle | Stop | Bundle | Mixed
KINDS: dict[int, type] = {
    cls.KIND: cls for cls in (Admit, Prefill, Round, Verify, Release, Idle, Stop, Bundle, Mixed)
}
BUNDLED = (Admit, Release, Prefill, Round, Verify, Mixed)

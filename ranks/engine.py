"""What every rank applies: admissions, prefill passes, decode rounds, releases and cache moves.

Rank 0 and the followers call the same methods with the same arguments in the same order, so
their bookkeeping (lanes, block tables, cache slots) stays identical. KV lives in blocks of the pool
(ranks/kv_store.py); each lane has a block table that rank 0's lane host fills (server/kv_blocks.py)
and sends with the passes, so no rank allocates: a rank only checks that a table it is given is
sound (blocks in the pool, none held by two lanes) and refuses the call otherwise. Methods that can
fail return False and leave nothing changed; the caller votes and, when another rank failed, calls
the undo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tpserve.kernels.attention import SpanView
from tpserve.ranks.device_wait import to_host
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.model import TPModel

log = logging.getLogger(__name__)


@dataclass
class Lane:
    blocks: list[int]  # the block table: block ids holding positions 0, 1, ... in order
    length: int = 0  # tokens whose KV is computed (positions 0..length-1)
    drafts_from: int = 0  # after a Verify: where its drafts begin (a later round may drop them); 0: none


class EngineError(RuntimeError):
    """A call the engine refuses (bad lane, position or size): the host sent something inconsistent."""


class Engine:
    """`device_timeout_s` bounds the wait for a pass's logits to reach the host (on a GPU, where a
    lost peer leaves the stream waiting forever on its collective)."""

    def __init__(
        self,
        model: TPModel,
        kv: KVPool,
        cache_kv: KVPool | None = None,
        *,
        refuse_token: int | None = None,
        device_timeout_s: float = 60.0,
    ):
        self.model = model
        self.device_timeout_s = device_timeout_s
        self.refuse_token = refuse_token
        self.kv = kv
        self.cache_kv = cache_kv
        self.lanes: dict[int, Lane] = {}
        self.owner: dict[int, int] = {}  # block id -> the lane whose table holds it
        self.cache_slots: dict[int, tuple[int, int]] = {}  # entry id -> (start, num_tokens)

    # Admission ---------------------------------------------------------------------------------
    def admit(self, lane: int, blocks: tuple[int, ...]) -> None:
        if lane in self.lanes:
            raise EngineError(f"lane {lane} is already open")
        self._check_blocks(lane, blocks)
        self.lanes[lane] = Lane([])
        self._append(lane, blocks)

    def release(self, lane: int) -> None:
        state = self.lanes.pop(lane, None)
        if state is not None:
            for block in state.blocks:
                del self.owner[block]

    def _check_blocks(self, lane: int, blocks) -> None:
        for block in blocks:
            if not 0 <= block < self.kv.num_blocks or block in self.owner:
                holder = self.owner.get(block)
                raise EngineError(
                    f"lane {lane} given KV block {block}: outside the pool of {self.kv.num_blocks} "
                    f"or held by lane {holder}"
                )
        if len(set(blocks)) != len(blocks):
            raise EngineError(f"lane {lane} given a KV block twice: {list(blocks)}")

    def _append(self, lane: int, blocks) -> None:
        for block in blocks:
            self.owner[block] = lane
        self.lanes[lane].blocks.extend(blocks)

    def _grow(self, spans) -> None:
        """Append each span's new blocks to its lane's table (spans passed check())."""
        for lane, _, _, blocks in spans:
            self._append(lane, blocks)

    # Passes ------------------------------------------------------------------------------------
    @staticmethod
    def _spans(spans) -> list:
        """Spans as (lane, start, token ids, new blocks); a span of three has no new blocks."""
        return [span if len(span) == 4 else (*span, ()) for span in spans]

    def check(self, spans) -> bool:
        """Whether forward(spans) would be accepted: open lanes, each span at its lane's length, its
        positions inside the lane's blocks with the span's new ones, sound new blocks, no lane twice.
        spans: (lane, start, token ids, new blocks)."""
        seen, given = set(), set()
        for lane, start, tokens, blocks in self._spans(spans):
            state = self.lanes.get(lane)
            if state is None or lane in seen or not tokens or start != state.length:
                return False
            if start + len(tokens) > (len(state.blocks) + len(blocks)) * self.kv.block_size:
                return False
            if any(not 0 <= b < self.kv.num_blocks or b in self.owner or b in given for b in blocks):
                return False
            given.update(blocks)
            seen.add(lane)
        return True

    def refuses(self, spans) -> bool:
        """A fault drill: this rank refuses any prompt holding `refuse_token` (tests of rollback)."""
        return self.refuse_token is not None and any(self.refuse_token in span[2] for span in spans)

    def forward(
        self,
        spans: list[tuple[int, int, tuple[int, ...]]],
        *,
        every_row: bool = False,
        media_rows: list[list[int]] | None = None,
        media: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A prompt pass. spans: (lane, start, token ids, new blocks) that pass check(). Computes and stores their
        KV, advances the lanes, and returns the next-token logits of each span's last token
        ([num_spans, vocab] float32; with every_row, of every token in order) on rank 0, None elsewhere.

        media_rows: per span, the offsets of its tokens embedded as image features; media: those
        features in the same order ([rows, hidden], rank 0 only)."""
        return self._pass(spans, every_row, media_rows, media)

    def decode_round(self, steps: list[tuple[int, int, tuple[int, ...]]]) -> torch.Tensor | None:
        """One token per lane: (lane, position, (token,), new blocks), as forward. A lane a Verify left longer
        than `position` is first cut back to it: the drafts the host did not keep are dropped."""
        self._drop_unkept_drafts(steps)
        return self._pass(steps, every_row=False)

    def verify(self, spans: list[tuple[int, int, tuple[int, ...]]]) -> torch.Tensor | None:
        """A decode round with drafts: (lane, position, (token, *drafts), new blocks), with the logits of every
        row. The next round keeps the samples the host kept and drops the rest of the drafts."""
        self._drop_unkept_drafts(spans)
        logits = self._pass(spans, every_row=True)
        for lane, start, *_ in spans:
            self.lanes[lane].drafts_from = start + 1  # the fed token stays; its drafts may go
        return logits

    def _drop_unkept_drafts(self, spans) -> None:
        # Only the drafts a Verify fed may be dropped: a span anywhere else fails check().
        for lane, start, *_ in spans:
            state = self.lanes.get(lane)
            if state is not None and state.drafts_from and state.drafts_from <= start < state.length:
                state.length = start

    def _pass(self, spans, every_row: bool, media_rows=None, media=None) -> torch.Tensor | None:
        spans = self._spans(spans)
        if not self.check(spans):
            raise EngineError(
                f"inconsistent pass {[(lane, start, len(t), b) for lane, start, t, b in spans]}"
            )
        self._grow(spans)
        views, token_ids, positions, logit_rows, packed_media = [], [], [], [], []
        for index, (lane, start, tokens, _) in enumerate(spans):
            state = self.lanes[lane]
            views.append(SpanView(len(token_ids), start, len(tokens), tuple(state.blocks)))
            if media_rows is not None:
                packed_media.extend(len(token_ids) + row for row in media_rows[index])
            token_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            if every_row:
                logit_rows.extend(range(len(token_ids) - len(tokens), len(token_ids)))
            else:
                logit_rows.append(len(token_ids) - 1)
        if media is not None and media.shape[0] != len(packed_media):
            raise EngineError(f"{media.shape[0]} image feature rows for {len(packed_media)} image positions")
        device = self.model.device
        rows = torch.tensor(packed_media, dtype=torch.int64, device=device) if packed_media else None
        with torch.inference_mode():
            logits = self.model.forward(
                torch.tensor(token_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                views,
                self.kv,
                logit_rows,
                rows,
                media if packed_media else None,
            )
        if logits is not None:
            logits = to_host(logits, self.device_timeout_s, self._pass_name(spans))
        for lane, _, tokens, _ in spans:
            state = self.lanes[lane]
            state.length += len(tokens)
            state.drafts_from = 0
        return logits

    def _pass_name(self, spans) -> str:
        peers = ", ".join(f"rank {r}" for r in range(1, self.model.tp_size))
        who = f"a collective with {peers} never finished (lost or hung)" if peers else "the device hung"
        return f"rank 0: the logits of a pass over {len(spans)} span(s) never reached the host: {who}"

    def rewind(self, lengths: dict[int, int]) -> None:
        """Undo passes: put lanes back to earlier lengths (their later slots are simply ignored)."""
        for lane, length in lengths.items():
            if lane in self.lanes:
                self.lanes[lane].length = length

    def lengths(self, lanes) -> dict[int, int]:
        return {lane: self.lanes[lane].length for lane in lanes if lane in self.lanes}

    # Prompt-cache states -------------------------------------------------------------------------
    def keep(self, lane: int, num_tokens: int, entry_id: int) -> bool:
        state = self.lanes.get(lane)
        if (
            self.cache_kv is None
            or state is None
            or entry_id in self.cache_slots
            or num_tokens > state.length
        ):
            return False
        start = self.cache_kv.allocator.allocate(num_tokens)
        if start is None:
            return False
        self.cache_kv.copy_slots(self.kv, self._slots(state, num_tokens), range(start, start + num_tokens))
        self.cache_slots[entry_id] = (start, num_tokens)
        return True

    def restore(self, lane: int, entry_id: int, num_tokens: int) -> bool:
        state = self.lanes.get(lane)
        slot = self.cache_slots.get(entry_id)
        capacity = 0 if state is None else len(state.blocks) * self.kv.block_size
        if state is None or slot is None or state.length != 0 or num_tokens > min(slot[1], capacity):
            return False
        self.kv.copy_slots(
            self.cache_kv, range(slot[0], slot[0] + num_tokens), self._slots(state, num_tokens)
        )
        state.length = num_tokens
        return True

    def _slots(self, state: Lane, num_tokens: int) -> list[int]:
        """The pool slots of the lane's positions 0..num_tokens-1."""
        size = self.kv.block_size
        return [state.blocks[p // size] * size + p % size for p in range(num_tokens)]

    def evict(self, entry_id: int) -> None:
        slot = self.cache_slots.pop(entry_id, None)
        if slot is not None:
            self.cache_kv.allocator.free(slot[0])

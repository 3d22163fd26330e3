"""What every rank applies: admissions, prefill passes, decode rounds, releases and cache moves.

Rank 0 and the followers call the same methods with the same arguments in the same order, so
their bookkeeping (lanes, ranges, cache slots) stays identical. Methods that can fail return False
and leave nothing changed; the caller votes and, when another rank failed, calls the undo.
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
    base: int  # first slot of the lane's range in the KV pool
    capacity: int  # slots reserved
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
        self.cache_slots: dict[int, tuple[int, int]] = {}  # entry id -> (start, num_tokens)

    # Admission ---------------------------------------------------------------------------------
    def admit(self, lane: int, reserve_tokens: int) -> bool:
        if lane in self.lanes or reserve_tokens <= 0:
            return False
        base = self.kv.allocator.allocate(reserve_tokens)
        if base is None:
            return False
        self.lanes[lane] = Lane(base, reserve_tokens)
        return True

    def release(self, lane: int) -> None:
        state = self.lanes.pop(lane, None)
        if state is not None:
            self.kv.allocator.free(state.base)

    # Passes ------------------------------------------------------------------------------------
    def check(self, spans: list[tuple[int, int, tuple[int, ...]]]) -> bool:
        """Whether forward(spans) would be accepted: open lanes, each span at its lane's length, in
        its reservation, no lane twice."""
        seen = set()
        for lane, start, tokens in spans:
            state = self.lanes.get(lane)
            if state is None or lane in seen or not tokens or start != state.length:
                return False
            if start + len(tokens) > state.capacity:
                return False
            seen.add(lane)
        return True

    def refuses(self, spans) -> bool:
        """A fault drill: this rank refuses any prompt holding `refuse_token` (tests of rollback)."""
        return self.refuse_token is not None and any(self.refuse_token in tokens for _, _, tokens in spans)

    def forward(
        self,
        spans: list[tuple[int, int, tuple[int, ...]]],
        *,
        every_row: bool = False,
        media_rows: list[list[int]] | None = None,
        media: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A prompt pass. spans: (lane, start, token ids) that pass check(). Computes and stores their
        KV, advances the lanes, and returns the next-token logits of each span's last token
        ([num_spans, vocab] float32; with every_row, of every token in order) on rank 0, None elsewhere.

        media_rows: per span, the offsets of its tokens embedded as image features; media: those
        features in the same order ([rows, hidden], rank 0 only)."""
        return self._pass(spans, every_row, media_rows, media)

    def decode_round(self, steps: list[tuple[int, int, tuple[int, ...]]]) -> torch.Tensor | None:
        """One token per lane: (lane, position, (token,)), as forward. A lane a Verify left longer
        than `position` is first cut back to it: the drafts the host did not keep are dropped."""
        self._drop_unkept_drafts(steps)
        return self._pass(steps, every_row=False)

    def verify(self, spans: list[tuple[int, int, tuple[int, ...]]]) -> torch.Tensor | None:
        """A decode round with drafts: (lane, position, (token, *drafts)), with the logits of every
        row. The next round keeps the samples the host kept and drops the rest of the drafts."""
        self._drop_unkept_drafts(spans)
        logits = self._pass(spans, every_row=True)
        for lane, start, _ in spans:
            self.lanes[lane].drafts_from = start + 1  # the fed token stays; its drafts may go
        return logits

    def _drop_unkept_drafts(self, spans) -> None:
        # Only the drafts a Verify fed may be dropped: a span anywhere else fails check().
        for lane, start, _ in spans:
            state = self.lanes.get(lane)
            if state is not None and state.drafts_from and state.drafts_from <= start < state.length:
                state.length = start

    def _pass(self, spans, every_row: bool, media_rows=None, media=None) -> torch.Tensor | None:
        if not self.check(spans):
            raise EngineError(f"inconsistent pass {[(lane, start, len(t)) for lane, start, t in spans]}")
        views, token_ids, positions, logit_rows, packed_media = [], [], [], [], []
        for index, (lane, start, tokens) in enumerate(spans):
            state = self.lanes[lane]
            # Interim: the lane's range as a table of one-slot blocks (KVPool block_size 1).
            blocks = tuple(range(state.base, state.base + start + len(tokens)))
            views.append(SpanView(len(token_ids), start, len(tokens), blocks))
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
        for lane, _, tokens in spans:
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
        self.cache_kv.copy(self.kv, state.base, start, num_tokens)
        self.cache_slots[entry_id] = (start, num_tokens)
        return True

    def restore(self, lane: int, entry_id: int, num_tokens: int) -> bool:
        state = self.lanes.get(lane)
        slot = self.cache_slots.get(entry_id)
        if state is None or slot is None or state.length != 0 or num_tokens > min(slot[1], state.capacity):
            return False
        self.kv.copy(self.cache_kv, slot[0], state.base, num_tokens)
        state.length = num_tokens
        return True

    def evict(self, entry_id: int) -> None:
        slot = self.cache_slots.pop(entry_id, None)
        if slot is not None:
            self.cache_kv.allocator.free(slot[0])

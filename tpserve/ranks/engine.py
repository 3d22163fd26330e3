"""What every rank applies: admissions, prefill passes, decode rounds, releases and cache moves.

Rank 0 and the followers call the same methods with the same arguments in the same order, so
their bookkeeping (lanes, block tables: tpserve/ranks/lane_tables.py) stays identical. KV lives in
blocks of the pool (tpserve/ranks/kv_store.py), read and written through each lane's block table.
Methods that can fail return False and leave nothing changed; the caller votes on them.
"""

from __future__ import annotations

import logging

import torch

from tpserve.kernels.attention import SpanView
from tpserve.kernels.device_sampling import greedy_ids, shortlist
from tpserve.ranks.decode_runner import DecodeGraphs
from tpserve.ranks.device_wait import to_host
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.lane_tables import EngineError, LaneTables
from tpserve.ranks.model import TPModel
from tpserve.ranks.mrope import MRotary

log = logging.getLogger(__name__)


class Engine(LaneTables):
    """The lanes' block tables (LaneTables: what they check and record) with the KV pool they index
    and the passes over them. `device_timeout_s` bounds the wait for a pass's logits to reach the
    host (on a GPU, where a lost peer leaves the stream waiting forever on its collective).
    `decode_graphs`: decode rounds replay CUDA graphs (tpserve/ranks/decode_runner.py; eagerly off a
    GPU), the pool's last block kept out of every lane's table as their padding rows' spare block."""

    def __init__(
        self,
        model: TPModel,
        kv: KVPool,
        *,
        refuse_token: int | None = None,
        device_timeout_s: float = 60.0,
        decode_graphs: bool = False,
    ):
        # The lanes' blocks to hold (a graphed engine keeps the pool's last one spare).
        super().__init__(kv.num_blocks - 1 if decode_graphs else kv.num_blocks, kv.block_size)
        self.model = model
        self.device_timeout_s = device_timeout_s
        self.refuse_token = refuse_token
        self.kv = kv
        self.graphs = DecodeGraphs(model, kv, spare_block=self.num_blocks) if decode_graphs else None

    def admit(self, lane: int, blocks: tuple[int, ...], num_cached: int = 0, copy_from: int = -1) -> None:
        """Open `lane` on `blocks`, its first `num_cached` positions already computed: whole blocks
        of a shared cached prefix (which other lanes may hold), then, when it ends inside a block,
        that block's first slots copied from block `copy_from` (a partial match); the rest its own."""
        num_shared, num_copied = self.check_open(lane, blocks, num_cached, copy_from)
        if num_copied:
            self.kv.copy_slots(copy_from, blocks[num_shared], num_copied)
        self.open(lane, blocks, num_cached)

    def refuses(self, spans) -> bool:
        """A fault drill: this rank refuses any prompt holding `refuse_token` (tests of rollback),
        when asked: at a prompt's first pass, the one voted on."""
        return self.refuse_token is not None and any(self.refuse_token in span[2] for span in spans)

    def forward(
        self,
        spans: list[tuple[int, int, tuple[int, ...]]],
        *,
        every_row: bool | list[bool] = False,
        media_rows: list[list[int]] | None = None,
        media: torch.Tensor | None = None,
        rope: list[tuple[int, ...]] | None = None,
    ) -> torch.Tensor | None:
        """A prompt pass. spans: (lane, start, token ids, new blocks) that pass check(). Computes and stores their
        KV, advances the lanes, and returns the next-token logits of each span's last token
        ([num_spans, vocab] float32; with every_row, of every token in order; one flag for the pass or one
        per span) on rank 0, None elsewhere.

        media_rows: per span, the offsets of its tokens embedded as image features; media: those
        features in the same order ([rows, hidden], rank 0 only). rope: per span, its tokens' multimodal
        rotary positions (t..., h..., w...) or () (tpserve/ranks/wire_spans.py Span.rope)."""
        return self._pass(spans, every_row, media_rows, media, rope)

    def decode_round(
        self, steps: list[tuple[int, int, tuple[int, ...]]], *, greedy: bool = False, listed=None
    ) -> torch.Tensor | None:
        """One token per lane: (lane, position, (token,), new blocks), as forward. A lane a Verify left longer
        than `position` is first cut back to it: the drafts the host did not keep are dropped.
        greedy: every row's argmax, taken on the device ([lanes] int64: tpserve/kernels/device_sampling.py,
        for a round that greedy_on_device says needs nothing else of its logits), instead of the logits.
        listed: the rows' SamplingParams, for a round lists_on_device takes: its shortlist, taken on the
        device (tpserve/kernels/device_sampling.py shortlist, one int64 tensor), instead of the logits."""
        self.drop_unkept_drafts(steps)
        return self._pass(
            steps, every_row=False, greedy=greedy, listed=listed, graphed=self.graphs is not None
        )

    def verify(self, spans: list[tuple[int, int, tuple[int, ...]]]) -> torch.Tensor | None:
        """A decode round with drafts: (lane, position, (token, *drafts), new blocks), with the logits of every
        row. The next round keeps the samples the host kept and drops the rest of the drafts."""
        self.drop_unkept_drafts(spans)
        logits = self._pass(spans, every_row=True)
        for lane, start, *_ in spans:
            self.lanes[lane].drafts_from = start + 1  # the fed token stays; its drafts may go
        return logits

    def mixed(
        self,
        steps,
        verify: bool,
        prompts,
        media_rows: list[list[int]] | None = None,
        media=None,
        prompt_rows: list[bool] | None = None,
        rope: list[tuple[int, ...]] | None = None,
    ):
        """A decode round (a Verify when `verify`) and prompts (lane, start, token ids, new blocks:
        whole prompts, or a long prompt's chunk) in one pass, so decoding streams keep their pace
        and a step is one pass. Logits: the round's rows as decode_round's or verify's, then each
        prompt's last token's (every token's where `prompt_rows` says: a prompt's log
        probabilities). Each row is the same as in separate passes: every product and attention row
        is batch-invariant. media_rows: per prompt, its offsets embedded as image features (media:
        those features, in order); rope: per prompt, its multimodal rotary positions, as forward's."""
        self.drop_unkept_drafts(steps)
        spans = [*steps, *prompts]
        rows = None if media_rows is None else [[]] * len(steps) + list(media_rows)
        ropes = None if rope is None else [()] * len(steps) + list(rope)
        every_row = [verify] * len(steps) + list(prompt_rows or [False] * len(prompts))
        logits = self._pass(spans, every_row, rows, media, ropes)
        if verify:
            for lane, start, *_ in steps:
                self.lanes[lane].drafts_from = start + 1
        return logits

    def _pass(
        self,
        spans,
        every_row,
        media_rows=None,
        media=None,
        rope=None,
        greedy: bool = False,
        listed=None,
        graphed=False,
    ) -> torch.Tensor | None:
        """every_row: one flag for the pass or one per span (a span's rows' logits, or its last's);
        greedy: the rows' argmax ids instead of their logits, only the ids copied to the host;
        listed: per row, its SamplingParams: the rows' shortlist instead, only it copied to the host;
        graphed: a decode round, replayed as its bucket's graph where one takes it."""
        spans = self._spans(spans)
        every_row = every_row if isinstance(every_row, list) else [every_row] * len(spans)
        if not self.check(spans):
            raise EngineError(
                f"inconsistent pass {[(lane, start, len(t), b) for lane, start, t, b in spans]}"
            )
        self._grow(spans)
        views, token_ids, positions, logit_rows, packed_media, axes = [], [], [], [], [], []
        multimodal = isinstance(self.model.rotary, MRotary)
        see_each_other = media_rows is not None and self.model.images_see_each_other
        for index, (lane, start, tokens, _) in enumerate(spans):
            state = self.lanes[lane]
            images = image_ranges(start, media_rows[index]) if see_each_other else ()
            views.append(SpanView(len(token_ids), start, len(tokens), tuple(state.blocks), images))
            if media_rows is not None:
                packed_media.extend(len(token_ids) + row for row in media_rows[index])
            token_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            if multimodal:
                given = rope[index] if rope is not None else ()
                axes.append(_rope_axes(given, start, len(tokens), state.rope_delta))
            if every_row[index]:
                logit_rows.extend(range(len(token_ids) - len(tokens), len(token_ids)))
            else:
                logit_rows.append(len(token_ids) - 1)
        if media is not None and media.shape[0] != len(packed_media):
            raise EngineError(f"{media.shape[0]} image feature rows for {len(packed_media)} image positions")
        device = self.model.device
        rows = torch.tensor(packed_media, dtype=torch.int64, device=device) if packed_media else None
        if multimodal:  # [3, T]: the rotary's (t, h, w) rows (KV slots come from the spans)
            positions = [[p for span in axes for p in span[axis]] for axis in range(3)]
        with torch.inference_mode():
            if graphed and not multimodal and self.graphs.takes(len(views)):
                logits = self.graphs.run(views, token_ids, positions)
            else:
                logits = self._forward(views, token_ids, positions, logit_rows, rows, media, packed_media)
        if logits is not None:
            if greedy:
                logits = greedy_ids(logits)
            elif listed is not None:
                logits = shortlist(
                    logits, listed, lambda size: to_host(size, self.device_timeout_s, "a shortlist's size")
                )
            logits = to_host(logits, self.device_timeout_s, self._pass_name(spans))
        for index, (lane, _, tokens, _) in enumerate(spans):
            state = self.lanes[lane]
            state.length += len(tokens)
            state.drafts_from = 0
            state.passed = True
            if multimodal and rope is not None and rope[index]:
                state.rope_delta = rope[index][-1]  # rank 0's: the prompt's largest position + 1 - its length
        return logits

    def _forward(self, views, token_ids, positions, logit_rows, rows, media, packed_media):
        device = self.model.device
        return self.model.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            views,
            self.kv,
            logit_rows,
            rows,
            media if packed_media else None,
        )

    def _pass_name(self, spans) -> str:
        peers = ", ".join(f"rank {r}" for r in range(1, self.model.tp_size))
        who = f"a collective with {peers} never finished (lost or hung)" if peers else "the device hung"
        return f"rank 0: the logits of a pass over {len(spans)} span(s) never reached the host: {who}"


def image_ranges(start: int, rows) -> tuple[tuple[int, int], ...]:
    """A span's images as (first, end) positions: its image rows' offsets (rising) in runs of
    consecutive ones, as transformers groups image tokens (get_block_sequence_ids_for_mask)."""
    ranges: list[list[int]] = []
    for row in rows:
        if ranges and ranges[-1][1] == start + row:
            ranges[-1][1] += 1
        else:
            ranges.append([start + row, start + row + 1])
    return tuple((first, end) for first, end in ranges)


def _rope_axes(given, start: int, length: int, delta: int) -> list[list[int]]:
    """A span's (t, h, w) position lists: as given (then the delta after them), or each KV position
    plus the lane's delta."""
    if given:
        if len(given) != 3 * length + 1:
            raise EngineError(f"{len(given)} rope positions for a span of {length} tokens")
        return [list(given[axis * length : (axis + 1) * length]) for axis in range(3)]
    return [list(range(start + delta, start + delta + length))] * 3


def open_lane(engine: Engine, lane: int, num_tokens: int) -> tuple[int, ...]:
    """Open `lane` with blocks for positions 0..num_tokens-1, the lowest free ids first: for tools
    that drive one engine alone (benchmarks, checks), where no lane host books the blocks. The block
    ids it got; EngineError when the pool has too few free."""
    size, held = engine.kv.block_size, set(engine.refs)
    free = [block for block in range(engine.num_blocks) if block not in held]
    blocks = tuple(free[: -(-num_tokens // size)])
    if len(blocks) * size < num_tokens:
        raise EngineError(f"lane {lane}: the pool has no room for {num_tokens} more tokens")
    engine.admit(lane, blocks)
    return blocks

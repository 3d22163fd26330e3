"""Batch-invariant attention: every product has one fixed shape, whatever the pass.

A span's queries are grouped under their KV head (query head h reads KV head h // g), laid out
position-major ([n positions x g heads] rows) and cut into tiles of ROW_TILE rows; its keys are cut
into blocks of KEY_BLOCK. (ROW_TILE is attention's own, smaller than the linear layers' tile: a
decode step has only g rows per KV head, and every row past them in its tile is work thrown away.)
Every product is then a batch of
    scores   [ROW_TILE, D] x [D, KEY_BLOCK]
    values   [ROW_TILE, KEY_BLOCK] x [KEY_BLOCK, D]
    weights  [ROW_TILE, KEY_BLOCK] x [KEY_BLOCK, ROW_TILE] of ones
where the last sums the weights, the softmax's denominator, in a product too. (Ones of one column,
[KEY_BLOCK, 1], would be a matrix-vector shape, which the BLAS rounds differently by batch size.)
The BLAS computes each output element of a product from its own row and column only, so a row's
numbers depend on its own query and the keys it sees: not on the rows beside it in its tile, the
number of tiles, or how many keys lie past its position. Around the products, the softmax takes each
row's maximum (order-free) and its exponentials (elementwise), and the blocks' partial sums are added
in block order in float32. Every product runs in float32, a bfloat16 pass's too (rounded once, at the
end). A masked key weighs exactly zero, and a masked key's slot always holds finite numbers (a gather
clamps to the span's last key), so masked keys add exactly nothing.

A sliding-window layer masks the keys before a row's window too (key j hidden from position p where
j <= p - window), a bias per window built once a pass; a sink (gpt-oss's per-head logit in the
denominator) is one more exponential, exp(sink - m), added to each row's total after its blocks.

So a chunk, a prompt after a prompt-cache restore, a decode step and a Verify give a row the very
numbers of a whole prefill, on any CPU whose BLAS is deterministic for a fixed shape; the start-up
probe (tpserve/ranks/probe.py) checks that on the machine at hand.

Spans of up to SHORT_ROWS grouped rows per head (decode steps, Verifies, short prompts) are computed
together, keys gathered per tile; a longer span is computed alone, its keys gathered once and shared
by every tile (a stride-0 batch), so a long prompt's keys are not copied once per tile. Either
gathers a span's keys through its block table (tpserve/kernels/attention.py), in position order: the same
keys in the same places of every product as a contiguous layout gives, so the same bits. A long span's tile skips
the key blocks that lie wholly past its last row's position (causal: about half of a long prompt's
blocks): their weights would all be zero, and a skipped block adds nothing where it would have added
exact zeros.
"""

from __future__ import annotations

import bisect

import torch

from tpserve.kernels.attention import BlockTables

# Rows of every attention product. Against 16 (the linear layers' tile), 4 made a 16-lane decode
# round of the default model 21-24% faster at 160 and 600 keys (CPU time, one thread, int8).
ROW_TILE = 4
KEY_BLOCK = 128  # keys per product (a decode round at 100 and 600 keys: 1.3-1.8x faster than 256)
SHORT_ROWS = 64  # a span of at most this many grouped rows per KV head is batched with the others


def num_tiles(num_rows: int) -> int:
    return -(-num_rows // ROW_TILE)


def num_blocks(num_keys: int) -> int:
    return -(-num_keys // KEY_BLOCK)


class TiledPlan:
    """The index tensors of one pass, built once and shared by every layer (and piece).

    spans: the pass's SpanViews; group: query heads per KV head; num_slots: slots per KV head in the
    pool (pool_k, pool_v: [Hkv, num_slots, D]), in KV blocks of block_size; num_rows: rows of the
    pass's q (its tokens, maybe padded to whole row tiles).
    """

    def __init__(
        self, spans, group: int, num_slots: int, block_size: int, device, num_rows: int | None = None
    ):
        self.spans, self.group, self.num_slots, self.device = spans, group, num_slots, device
        self.num_rows = sum(s.length for s in spans) if num_rows is None else num_rows
        tables = BlockTables(spans, block_size, num_slots)
        self.short = [s for s in spans if s.length * group <= SHORT_ROWS]
        self._short: dict[int, _ShortBatch] = {}
        if self.short:  # [short spans, blocks * KEY_BLOCK] slots of their keys (padded: finite, masked)
            indices = [i for i, s in enumerate(spans) if s.length * group <= SHORT_ROWS]
            blocks = max(num_blocks(s.end) for s in self.short)
            self.short_slots = tables.key_slots(indices, blocks * KEY_BLOCK)
        # Each long span with its key slots and the first tile that sees each key block; its mask
        # bias [tiles, blocks, ROW_TILE, KEY_BLOCK] per window (long_bias).
        self.long = [
            (
                s,
                tables.key_slots([i], num_blocks(s.end) * KEY_BLOCK)[0].to(device),
                _first_tiles(s, group),
            )
            for i, s in enumerate(spans)
            if s.length * group > SHORT_ROWS
        ]
        self._long_bias: dict[tuple[int, int], torch.Tensor] = {}

    def long_bias(self, index: int, window: int) -> torch.Tensor:
        """Long span `index`'s mask bias for a layer of `window` (0: none), built once a pass."""
        if (index, window) not in self._long_bias:
            span = self.long[index][0]
            bias = _bias(_row_positions(span, self.group), num_blocks(span.end), window)
            self._long_bias[index, window] = bias.to(self.device)
        return self._long_bias[index, window]

    def short_batch(self, num_kv_heads: int) -> _ShortBatch | None:
        if not self.short:
            return None
        if num_kv_heads not in self._short:
            self._short[num_kv_heads] = _ShortBatch(
                self.short,
                self.short_slots,
                self.group,
                num_kv_heads,
                self.num_slots,
                self.device,
                dump_row=self.num_rows * num_kv_heads * self.group,
            )
        return self._short[num_kv_heads]


class _ShortBatch:
    """Short spans' tiles for one KV-head count: entry e = (span, KV head, tile)."""

    def __init__(self, spans, slots, group: int, num_kv_heads: int, num_slots: int, device, dump_row: int):
        # slots: [spans, blocks * KEY_BLOCK] of their keys (TiledPlan.short_slots)
        num_heads = num_kv_heads * group
        self.num_blocks = slots.shape[1] // KEY_BLOCK
        # Built in Python lists and turned into tensors once: a round of many lanes runs no
        # operation per entry.
        q_rows, out_rows, positions, entry_spans, entry_heads = [], [], [], [], []
        for index, span in enumerate(spans):
            rows = span.length * group
            for head in range(num_kv_heads):
                for tile in range(num_tiles(rows)):
                    for i in range(ROW_TILE):
                        r = min(tile * ROW_TILE + i, rows - 1)  # padding rows repeat the last row
                        q_rows.append((span.offset + r // group) * num_heads + head * group + r % group)
                        out_rows.append(q_rows[-1] if tile * ROW_TILE + i < rows else dump_row)
                        positions.append(span.start + r // group)
                entry_spans += [index] * num_tiles(rows)
                entry_heads += [head] * num_tiles(rows)
        self.num_entries = len(entry_spans)
        self.q_index = torch.tensor(q_rows, device=device)  # [E*ROW_TILE] rows of q as [T*Hq, D]
        self.out_index = torch.tensor(out_rows, device=device)  # where they go; padding: the dump row
        # The other way round, where every row of q finds its result (a row no span holds, a pass's
        # padding, reads entry 0's): a pass of short spans only gathers its output in one call.
        result_rows = [0] * dump_row
        for entry_row, q_row in enumerate(out_rows):
            if q_row != dump_row:
                result_rows[q_row] = entry_row
        self.result_index = torch.tensor(result_rows, device=device)  # [T*Hq]
        self.positions, self.device = torch.tensor(positions), device
        self._bias: dict[int, torch.Tensor] = {}
        # The entries' keys as rows of the pool seen as [Hkv*slots, D]: [E * nb * KEY_BLOCK]
        heads = torch.tensor(entry_heads).unsqueeze(1) * num_slots
        self.key_rows = (slots[torch.tensor(entry_spans)] + heads).view(-1).to(device)
        self.row_heads = torch.tensor(
            [(q_row % num_heads) for q_row in q_rows], device=device
        )  # [E*ROW_TILE] the query head of each entry row (its sink)

    def bias(self, window: int) -> torch.Tensor:
        """The entries' mask bias for a layer of `window` (0: none), built once a pass."""
        if window not in self._bias:
            self._bias[window] = _bias(self.positions, self.num_blocks, window).to(self.device)
        return self._bias[window]


def _row_positions(span, group: int) -> torch.Tensor:
    """[num_tiles, ROW_TILE] positions of a span's grouped rows; padding rows sit at its last one."""
    rows = span.length * group
    padded = torch.arange(num_tiles(rows) * ROW_TILE).clamp(max=rows - 1)
    return (span.start + padded // group).view(-1, ROW_TILE)


def _first_tiles(span, group: int) -> list[int]:
    """Per key block of a span, the first of its tiles whose last row sees a key of the block (the
    tiles before it lie wholly before the block: causal)."""
    last = _row_positions(span, group)[:, -1].tolist()  # each tile's last (largest) position
    return [bisect.bisect_left(last, block * KEY_BLOCK) for block in range(num_blocks(span.end))]


def _bias(positions: torch.Tensor, num_key_blocks: int, window: int = 0) -> torch.Tensor:
    """[tiles, blocks, ROW_TILE, KEY_BLOCK] float32: -inf where key j lies past the row's position
    p (j > p), or before its window (j <= p - window, where window is set), else 0; added to the
    scores, it leaves a visible score's bits as they are."""
    keys = torch.arange(num_key_blocks * KEY_BLOCK).view(1, num_key_blocks, 1, KEY_BLOCK)
    rows = positions.view(-1, 1, ROW_TILE, 1)
    hidden = keys > rows
    if window:
        hidden |= keys <= rows - window
    return torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))


def tiled_attention(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    plan: TiledPlan,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] (rotated); pool_*: [Hkv, slots, D] already holding the spans' keys. Returns [T, Hq*D].
    window: a row at position p sees keys p - window + 1 .. p (0: all of 0 .. p); sinks: [Hq] logits
    in each row's softmax denominator, or None."""
    window = int(window or 0)
    sinks = None if sinks is None else sinks.float().to(q.device)
    # Products in float32 whatever q's dtype, rounded once to it at the end: a bfloat16 product's
    # output would round every score (GLM-4.5's, whose biased, normed heads share a large unrotated
    # part, reach 14, where a bfloat16 step is 1/16) and every block's weighted values and weight
    # sums, which transformers' own forward (SDPA's) keeps in float32: GLM-4.5's bfloat16 logits
    # were 1.37x as far from float32 as transformers', 1.07x so (tests/test_bfloat16_families.py)
    dtype, q = q.dtype, q.float()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = pool_k.shape[0]
    group = plan.group
    batch = plan.short_batch(num_kv_heads)
    if batch is not None:
        num_entries, blocks = batch.num_entries, batch.num_blocks
        tiles = (
            q.reshape(-1, head_dim).index_select(0, batch.q_index).view(num_entries, 1, ROW_TILE, head_dim)
        )
        if blocks > 1:  # every block's product in one batched call
            tiles = tiles.expand(num_entries, blocks, ROW_TILE, head_dim)
        tiles = tiles.reshape(num_entries * blocks, ROW_TILE, head_dim)
        keys = _widened(pool_k.reshape(-1, head_dim).index_select(0, batch.key_rows), q).view(
            -1, KEY_BLOCK, head_dim
        )
        values = _widened(pool_v.reshape(-1, head_dim).index_select(0, batch.key_rows), q).view(
            -1, KEY_BLOCK, head_dim
        )
        scores = torch.bmm(tiles, keys.transpose(1, 2)).view(num_entries, blocks, ROW_TILE, KEY_BLOCK)
        entry_sinks = None if sinks is None else sinks[batch.row_heads].view(num_entries, 1, ROW_TILE, 1)
        weights, sink_terms = _softmax_weights(scores, batch.bias(window), scale, values.dtype, entry_sinks)
        weights = weights.view(-1, ROW_TILE, KEY_BLOCK)
        shape = (num_entries, blocks, ROW_TILE, -1)
        sums = torch.bmm(weights, values).view(shape).unbind(1)
        totals = torch.bmm(weights, _ones(weights)).view(shape).unbind(1)
        result = _normalised(sums, totals, dtype, sink_terms=sink_terms).view(-1, head_dim)
        if not plan.long:
            return result.index_select(0, batch.result_index).view(num_tokens, num_heads * head_dim)
    # One spare row past q's: where the short batch's padding rows are written, and dropped.
    out = torch.zeros(num_tokens * num_heads + 1, head_dim, dtype=dtype, device=q.device)
    if batch is not None:
        out.index_copy_(0, batch.out_index, result)
    out = out[:-1].view(num_tokens, num_heads, head_dim)
    for index, (span, slots, firsts) in enumerate(plan.long):
        bias = plan.long_bias(index, window)
        rows = span.length * group
        span_tiles, blocks = bias.shape[0], bias.shape[1]
        for head in range(num_kv_heads):
            heads = slice(head * group, (head + 1) * group)
            tiles = q[span.offset : span.offset + span.length, heads].reshape(rows, head_dim)
            tiles = torch.cat([tiles, tiles.new_zeros(span_tiles * ROW_TILE - rows, head_dim)])
            tiles = tiles.view(span_tiles, ROW_TILE, head_dim)
            # The span's keys once, shared by every tile (a stride-0 batch), a block at a time; a
            # block's product runs on the tiles that see it only (the bias hides the rest's zeros).
            keys = _widened(pool_k[head].index_select(0, slots), q).view(blocks, KEY_BLOCK, head_dim)
            values = _widened(pool_v[head].index_select(0, slots), q).view(blocks, KEY_BLOCK, head_dim)
            scores = tiles.new_zeros(span_tiles, blocks, ROW_TILE, KEY_BLOCK)
            for b, first in enumerate(firsts):
                seen = tiles[first:]
                scores[first:, b] = torch.bmm(seen, keys[b].t().expand(seen.shape[0], -1, -1))
            row_sinks = None
            if sinks is not None:  # [tiles, 1, ROW_TILE, 1]: row r's head is head * group + r % group
                heads_of_rows = head * group + torch.arange(span_tiles * ROW_TILE) % group
                row_sinks = sinks[heads_of_rows.to(sinks.device)].view(span_tiles, 1, ROW_TILE, 1)
            weights, sink_terms = _softmax_weights(scores, bias, scale, values.dtype, row_sinks)
            seen = [weights[first:, b] for b, first in enumerate(firsts)]
            sums = [torch.bmm(w, values[b].expand(w.shape[0], -1, -1)) for b, w in enumerate(seen)]
            totals = [torch.bmm(w, _ones(w)) for w in seen]
            result = _normalised(sums, totals, dtype, firsts, sink_terms).view(-1, head_dim)[:rows]
            out[span.offset : span.offset + span.length, heads] = result.view(span.length, group, head_dim)
    return out.reshape(num_tokens, num_heads * head_dim)


def _widened(gathered: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Gathered keys or values in q's dtype, float32 (a pool kept in a narrower one, or bfloat16:
    tpserve/kernels/attention_kernels.py kv_dtype)."""
    return gathered if gathered.dtype == q.dtype else gathered.to(q.dtype)


def _ones(weights: torch.Tensor) -> torch.Tensor:
    """[E, KEY_BLOCK, ROW_TILE] ones (stride 0), whose product with weights [E, ROW_TILE, KEY_BLOCK]
    holds each row's sum of weights in every column."""
    return weights.new_ones(1, KEY_BLOCK, ROW_TILE).expand(weights.shape[0], -1, -1)


def _softmax_weights(scores: torch.Tensor, bias: torch.Tensor, scale: float, dtype, sinks=None):
    """scores [E, nb, ROW_TILE, KEY_BLOCK] -> unnormalised softmax weights in `dtype`: exp(s - m)
    over each row's visible keys (the max is order-free; every row sees at least its own key), m the
    maximum of them and the row's sink ([E, 1, ROW_TILE, 1] or None); and the sinks' terms exp(sink
    - m) [E, ROW_TILE, 1] float32 (None without sinks)."""
    scores = scores if scores.dtype == torch.float32 else scores.float()
    scores = scores * scale + bias
    top = scores.amax(dim=(1, 3), keepdim=True)
    terms = None
    if sinks is not None:
        top = torch.maximum(top, sinks)
        terms = torch.exp(sinks - top).view(top.shape[0], ROW_TILE, 1)
    weights = torch.exp(scores - top)
    return (weights if weights.dtype == dtype else weights.to(dtype)), terms


def _normalised(sums, totals, dtype, firsts=None, sink_terms=None) -> torch.Tensor:
    """The weighted values divided by the summed weights: each the blocks' partial sums ([E,
    ROW_TILE, D] and [E, ROW_TILE, ROW_TILE]; block b's for entries firsts[b]: on) added in block
    order in float32, then the sinks' terms ([E, ROW_TILE, 1]) to the totals. Returns [E, ROW_TILE, D]."""
    firsts = firsts or [0] * len(sums)
    total = _in_block_order(totals, firsts)[..., :1]
    if sink_terms is not None:
        total = total + sink_terms
    out = _in_block_order(sums, firsts) / total
    return out if out.dtype == dtype else out.to(dtype)


def _in_block_order(parts, firsts) -> torch.Tensor:
    total = None
    for first, part in zip(firsts, parts):
        part = part if part.dtype == torch.float32 else part.float()
        if total is None:  # block 0: every entry sees key 0
            total = part
        else:
            total[first:] += part
    return total

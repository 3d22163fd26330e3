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
j <= p - window), a bias per window built once a pass, and skips the key blocks wholly before a
tile's window as the causal rule skips those wholly past it (below); a sink (gpt-oss's per-head logit in the
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
exact zeros. So in a sliding-window layer: a long span's tile skips the blocks wholly before its first
row's window, and the short spans' keys start at the block of each span's first window (a decode row
at position 4,000 in a window of 128 reads 2 blocks, not 32); neither reads those keys at all.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from tpserve.kernels.attention import BlockTables, first_key, last_keys

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
        self._short_indices = [i for i, s in enumerate(spans) if s.length * group <= SHORT_ROWS]
        self._tables = tables
        # Each long span with its key slots and the first tile that sees each key block; the key
        # blocks its tiles see per window, with their mask biases (long_blocks).
        self.long = [
            (
                s,
                tables.key_slots([i], num_blocks(s.end) * KEY_BLOCK)[0].to(device),
                _first_tiles(s, group),
            )
            for i, s in enumerate(spans)
            if s.length * group > SHORT_ROWS
        ]
        self._long_blocks: dict[tuple[int, int], list[_SeenBlock]] = {}

    def long_blocks(self, index: int, window: int) -> list[_SeenBlock]:
        """Long span `index`'s key blocks that some tile sees in a layer of `window` (0: none), in
        block order, each with the tiles that see it and their mask bias; built once a pass."""
        if (index, window) not in self._long_blocks:
            span, _, firsts = self.long[index]
            positions = _row_positions(span, self.group)  # [tiles, ROW_TILE]
            last = last_keys(span, positions)
            ends = _end_tiles(positions, len(firsts), window)
            self._long_blocks[index, window] = [
                _SeenBlock(block, first, end,
                           _bias(positions[first:end], last[first:end], 1, window, block * KEY_BLOCK)
                           .view(end - first, ROW_TILE, KEY_BLOCK).to(self.device))
                for block, (first, end) in enumerate(zip(firsts, ends))
                if first < end
            ]  # fmt: skip
        return self._long_blocks[index, window]

    def short_slots(self, window: int) -> tuple[list[int], torch.Tensor]:
        """The short spans' first key block in a layer of `window` (the block of each span's first
        row's first key), and [short spans, blocks * KEY_BLOCK] slots of their keys from it (padded
        past each span's end with its last key's: finite, and masked)."""
        starts = [_window_block(s.start, window) for s in self.short]
        blocks = max(num_blocks(s.end) - start for s, start in zip(self.short, starts))
        first_keys = [start * KEY_BLOCK for start in starts]
        return starts, self._tables.key_slots(self._short_indices, blocks * KEY_BLOCK, first_keys)

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


class _SeenBlock(NamedTuple):
    """A long span's key block in one window's layers: the tiles first..end-1 see some of its keys,
    bias [end - first, ROW_TILE, KEY_BLOCK] masks the rest."""

    block: int
    first: int
    end: int
    bias: torch.Tensor


class _ShortKeys(NamedTuple):
    """The short batch's keys in one window's layers: num_blocks key blocks per entry, from each
    entry's span's first window block; rows: their rows of the pool seen as [Hkv*slots, D], [E *
    num_blocks * KEY_BLOCK]; bias: [E, num_blocks, ROW_TILE, KEY_BLOCK]."""

    num_blocks: int
    rows: torch.Tensor
    bias: torch.Tensor


class _ShortBatch:
    """Short spans' tiles for one KV-head count: entry e = (span, KV head, tile)."""

    def __init__(self, spans, slots, group: int, num_kv_heads: int, num_slots: int, device, dump_row: int):
        # slots: window -> the spans' first key blocks and key slots (TiledPlan.short_slots)
        num_heads = num_kv_heads * group
        self._slots, self._num_slots = slots, num_slots
        # Built in Python lists and turned into tensors once: a round of many lanes runs no
        # operation per entry.
        q_rows, out_rows, positions, last, entry_spans, entry_heads = [], [], [], [], [], []
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
            span_positions = positions[len(last) :]
            last += last_keys(span, torch.tensor(span_positions)).tolist() if span.images else span_positions
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
        self.last_keys = torch.tensor(last)  # [E*ROW_TILE] each row's last key (last_keys)
        self._entry_spans, self._entry_heads = torch.tensor(entry_spans), torch.tensor(entry_heads)
        self._keys: dict[int, _ShortKeys] = {}
        self.row_heads = torch.tensor(
            [(q_row % num_heads) for q_row in q_rows], device=device
        )  # [E*ROW_TILE] the query head of each entry row (its sink)

    def keys(self, window: int) -> _ShortKeys:
        """The entries' keys and mask bias for a layer of `window` (0: none), built once a pass."""
        if window not in self._keys:
            starts, slots = self._slots(window)
            blocks = slots.shape[1] // KEY_BLOCK
            heads = self._entry_heads.unsqueeze(1) * self._num_slots
            rows = (slots[self._entry_spans] + heads).view(-1).to(self.device)
            first_keys = torch.tensor(starts)[self._entry_spans] * KEY_BLOCK
            bias = _bias(self.positions, self.last_keys, blocks, window, first_keys).to(self.device)
            self._keys[window] = _ShortKeys(blocks, rows, bias)
        return self._keys[window]


def _row_positions(span, group: int) -> torch.Tensor:
    """[num_tiles, ROW_TILE] positions of a span's grouped rows; padding rows sit at its last one."""
    rows = span.length * group
    padded = torch.arange(num_tiles(rows) * ROW_TILE).clamp(max=rows - 1)
    return (span.start + padded // group).view(-1, ROW_TILE)


def _first_tiles(span, group: int) -> list[int]:
    """Per key block of a span, the first of its tiles whose last row sees a key of the block (the
    tiles before it lie wholly before the block: causal)."""
    last = last_keys(span, _row_positions(span, group))[:, -1].tolist()  # each tile's last (largest) key
    return [bisect.bisect_left(last, block * KEY_BLOCK) for block in range(num_blocks(span.end))]


def _window_block(position: int, window: int) -> int:
    """The key block of the first key a row at `position` sees in a layer of `window` (0: none)."""
    return first_key(position, window) // KEY_BLOCK


def _end_tiles(positions: torch.Tensor, num_key_blocks: int, window: int) -> list[int]:
    """Per key block, one past the last tile (positions [tiles, ROW_TILE]) whose first row's window
    reaches into the block: the tiles from it on lie wholly past the block's keys (0: every tile)."""
    if not window:
        return [positions.shape[0]] * num_key_blocks
    lows = (positions[:, 0] + 1 - window).tolist()  # each tile's first row's first key, rising
    return [bisect.bisect_left(lows, (block + 1) * KEY_BLOCK) for block in range(num_key_blocks)]


def _bias(
    positions: torch.Tensor, last: torch.Tensor, num_key_blocks: int, window: int = 0, first_key=0
) -> torch.Tensor:
    """[tiles, blocks, ROW_TILE, KEY_BLOCK] float32: -inf where key j lies past the row's last key
    (last: its position p, or its image's last: last_keys), or before its window (j <= p - window,
    where window is set), else 0; added to the scores, it leaves a visible score's bits as they are.
    positions, last: [tiles, ROW_TILE]; first_key: the position of each tile's first key (an int, or
    [tiles])."""
    if isinstance(first_key, torch.Tensor):
        first_key = first_key.view(-1, 1, 1, 1)
    keys = torch.arange(num_key_blocks * KEY_BLOCK).view(1, num_key_blocks, 1, KEY_BLOCK) + first_key
    rows = positions.view(-1, 1, ROW_TILE, 1)
    hidden = keys > last.view(-1, 1, ROW_TILE, 1)
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
        short_keys = batch.keys(window)
        num_entries, blocks = batch.num_entries, short_keys.num_blocks
        tiles = (
            q.reshape(-1, head_dim).index_select(0, batch.q_index).view(num_entries, 1, ROW_TILE, head_dim)
        )
        if blocks > 1:  # every block's product in one batched call
            tiles = tiles.expand(num_entries, blocks, ROW_TILE, head_dim)
        tiles = tiles.reshape(num_entries * blocks, ROW_TILE, head_dim)
        keys = _widened(pool_k.reshape(-1, head_dim).index_select(0, short_keys.rows), q).view(
            -1, KEY_BLOCK, head_dim
        )
        values = _widened(pool_v.reshape(-1, head_dim).index_select(0, short_keys.rows), q).view(
            -1, KEY_BLOCK, head_dim
        )
        scores = torch.bmm(tiles, keys.transpose(1, 2)).view(num_entries, blocks, ROW_TILE, KEY_BLOCK)
        entry_sinks = None if sinks is None else sinks[batch.row_heads].view(num_entries, 1, ROW_TILE, 1)
        weights, sink_terms = _softmax_weights(scores, short_keys.bias, scale, values.dtype, entry_sinks)
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
    for index, (span, slots, _) in enumerate(plan.long):
        seen = plan.long_blocks(index, window)
        ranges = [(block.first, block.end) for block in seen]
        rows = span.length * group
        span_tiles = num_tiles(rows)
        # the blocks some tile sees lie side by side (seen[0].block .. the span's last): their keys
        low = seen[0].block
        slots = slots[low * KEY_BLOCK :]
        for head in range(num_kv_heads):
            heads = slice(head * group, (head + 1) * group)
            tiles = q[span.offset : span.offset + span.length, heads].reshape(rows, head_dim)
            tiles = torch.cat([tiles, tiles.new_zeros(span_tiles * ROW_TILE - rows, head_dim)])
            tiles = tiles.view(span_tiles, ROW_TILE, head_dim)
            # The span's keys once, shared by every tile (a stride-0 batch), a block at a time; a
            # block's product runs on the tiles that see it only (the bias hides the rest's zeros).
            keys = _widened(pool_k[head].index_select(0, slots), q).view(-1, KEY_BLOCK, head_dim)
            values = _widened(pool_v[head].index_select(0, slots), q).view(-1, KEY_BLOCK, head_dim)
            scores = [
                torch.bmm(tiles[b.first : b.end], keys[b.block - low].t().expand(b.end - b.first, -1, -1))
                for b in seen
            ]
            row_sinks = None
            if sinks is not None:  # [tiles, ROW_TILE, 1]: row r's head is head * group + r % group
                heads_of_rows = head * group + torch.arange(span_tiles * ROW_TILE) % group
                row_sinks = sinks[heads_of_rows.to(sinks.device)].view(span_tiles, ROW_TILE, 1)
            weights, sink_terms = _seen_softmax_weights(
                scores, seen, span_tiles, scale, values.dtype, row_sinks
            )
            sums = [
                torch.bmm(w, values[b.block - low].expand(w.shape[0], -1, -1)) for b, w in zip(seen, weights)
            ]
            totals = [torch.bmm(w, _ones(w)) for w in weights]
            result = _normalised(sums, totals, dtype, ranges, sink_terms).view(-1, head_dim)[:rows]
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


def _seen_softmax_weights(scores, seen, num_entries: int, scale: float, dtype, sinks=None):
    """_softmax_weights for a long span's seen blocks: scores [end - first, ROW_TILE, KEY_BLOCK] of
    each block's tiles (seen: its _SeenBlocks), sinks [E, ROW_TILE, 1] or None. The same numbers as
    over every block (a skipped block's keys would weigh exactly zero: each row's maximum is over
    the keys it sees, and every row sees its own), per seen block in `dtype`; and the sinks' terms."""
    scores = [s * scale + b.bias for s, b in zip(scores, seen)]
    top = scores[0].new_full((num_entries, ROW_TILE, 1), float("-inf"))
    for s, b in zip(scores, seen):
        top[b.first : b.end] = torch.maximum(top[b.first : b.end], s.amax(dim=2, keepdim=True))
    terms = None
    if sinks is not None:
        top = torch.maximum(top, sinks)
        terms = torch.exp(sinks - top)
    weights = [torch.exp(s - top[b.first : b.end]) for s, b in zip(scores, seen)]
    return [w if w.dtype == dtype else w.to(dtype) for w in weights], terms


def _normalised(sums, totals, dtype, ranges=None, sink_terms=None) -> torch.Tensor:
    """The weighted values divided by the summed weights: each the blocks' partial sums ([E,
    ROW_TILE, D] and [E, ROW_TILE, ROW_TILE]; block b's for entries ranges[b] = (first, end), None:
    every entry's) added in block order in float32, then the sinks' terms ([E, ROW_TILE, 1]) to the
    totals. Returns [E, ROW_TILE, D]."""
    total = _in_block_order(totals, ranges)[..., :1]
    if sink_terms is not None:
        total = total + sink_terms
    out = _in_block_order(sums, ranges) / total
    return out if out.dtype == dtype else out.to(dtype)


def _in_block_order(parts, ranges) -> torch.Tensor:
    # An entry's first partial is its total (0 + x is x, as a skipped block's exact zeros were)
    if ranges is None:
        ranges = [(0, parts[0].shape[0])] * len(parts)
    num_entries = max(end for _, end in ranges)
    total = None
    for (first, end), part in zip(ranges, parts):
        part = part if part.dtype == torch.float32 else part.float()
        if total is None and (first, end) == (0, num_entries):
            total = part
        elif total is None:
            total = part.new_zeros(num_entries, *part.shape[1:])
            total[first:end] += part
        else:
            total[first:end] += part
    return total

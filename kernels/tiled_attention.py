"""Batch-invariant attention: every product has one fixed shape, whatever the pass.

A span's queries are grouped under their KV head (query head h reads KV head h // g), laid out
position-major ([n positions x g heads] rows) and cut into tiles of ROW_TILE rows; its keys are cut
into blocks of KEY_BLOCK. Every product is then a batch of
    scores  [ROW_TILE, D] x [D, KEY_BLOCK]
    values  [ROW_TILE, KEY_BLOCK] x [KEY_BLOCK, D + 1]
where the values carry a column of ones, so the softmax's denominator (the sum of the weights) comes
from the same product as the weighted values. (A product of its own, [KEY_BLOCK, 1], is a
matrix-vector shape, which the BLAS rounds differently by batch size.)
The BLAS computes each output element of a product from its own row and column only, so a row's
numbers depend on its own query and the keys it sees: not on the rows beside it in its tile, the
number of tiles, or how many keys lie past its position. Around the products, the softmax takes each
row's maximum (order-free) and its exponentials (elementwise), and the blocks' partial sums are added
in block order in float32. A masked key weighs exactly zero, and a masked key's slot always holds
finite numbers (a gather clamps to the span's last key), so masked keys add exactly nothing.

So a chunk, a prompt after a prompt-cache restore, a decode step and a Verify give a row the very
numbers of a whole prefill, on any CPU whose BLAS is deterministic for a fixed shape; the start-up
probe (ranks/probe.py) checks that on the machine at hand.

Spans of up to SHORT_TILES tiles per head (decode steps, Verifies, short prompts) are computed
together, keys gathered per tile; a longer span is computed alone, its keys shared by every tile
(a stride-0 batch), so a long prompt's keys are not copied once per tile.
"""

from __future__ import annotations

import torch

from tpserve.kernels.linear import ROW_TILE

KEY_BLOCK = 256  # keys per product
SHORT_TILES = 4  # a span of at most this many row tiles per KV head is batched with the others


def num_tiles(num_rows: int) -> int:
    return -(-num_rows // ROW_TILE)


def num_blocks(num_keys: int) -> int:
    return -(-num_keys // KEY_BLOCK)


class TiledPlan:
    """The index tensors of one pass, built once and shared by every layer (and piece).

    spans: the pass's SpanViews; group: query heads per KV head; num_slots: slots per KV head in the
    pool (pool_k, pool_v: [Hkv, num_slots, D]).
    """

    def __init__(self, spans, group: int, num_slots: int, device):
        self.spans, self.group, self.num_slots, self.device = spans, group, num_slots, device
        self.short = [s for s in spans if num_tiles(s.length * group) <= SHORT_TILES]
        self.long = [s for s in spans if num_tiles(s.length * group) > SHORT_TILES]
        self._short: dict[int, _ShortBatch] = {}
        self._long_hidden = {
            s.offset: _hidden(_row_positions(s, group), num_blocks(s.end)) for s in self.long
        }
        self._long_keys = {s.offset: _key_slots(s, num_blocks(s.end), device) for s in self.long}

    def short_batch(self, num_kv_heads: int) -> _ShortBatch | None:
        if not self.short:
            return None
        if num_kv_heads not in self._short:
            self._short[num_kv_heads] = _ShortBatch(
                self.short,
                self.group,
                num_kv_heads,
                self.num_slots,
                self.device,
                zero_row=sum(s.length for s in self.spans) * num_kv_heads * self.group,
            )
        return self._short[num_kv_heads]


class _ShortBatch:
    """Short spans' tiles for one KV-head count: entry e = (span, KV head, tile)."""

    def __init__(self, spans, group: int, num_kv_heads: int, num_slots: int, device, zero_row: int):
        num_heads = num_kv_heads * group
        self.num_blocks = max(num_blocks(s.end) for s in spans)
        q_rows, positions, key_rows, real = [], [], [], []
        for span in spans:
            rows = span.length * group
            # Rows past the span's own (tile padding) read a zero query: the row appended after q's.
            slots = _key_slots(span, self.num_blocks, "cpu")
            span_positions = _row_positions(span, group)
            for head in range(num_kv_heads):
                for tile in range(num_tiles(rows)):
                    for i in range(ROW_TILE):
                        r = tile * ROW_TILE + i
                        if r < rows:
                            real.append(len(q_rows))
                            q_rows.append((span.offset + r // group) * num_heads + head * group + r % group)
                        else:
                            q_rows.append(zero_row)
                    positions.append(span_positions[tile])
                    key_rows.append(slots + head * num_slots)  # rows of the pool as [Hkv*slots, D]
        self.num_entries = len(positions)
        self.q_index = torch.tensor(q_rows, device=device)  # [E*ROW_TILE] into q rows + a zero row
        real_rows = torch.tensor(real, dtype=torch.int64)
        self.out_rows = torch.tensor([q_rows[i] for i in real], device=device)  # where real rows go
        self.real_rows = real_rows.to(device)
        self.hidden = _hidden(torch.stack(positions), self.num_blocks).to(device)
        self.key_rows = torch.stack(key_rows).view(-1).to(device)  # [E * nb * KEY_BLOCK]


def _row_positions(span, group: int) -> torch.Tensor:
    """[num_tiles, ROW_TILE] positions of a span's grouped rows; padding rows sit at its last one."""
    rows = span.length * group
    padded = torch.arange(num_tiles(rows) * ROW_TILE).clamp(max=rows - 1)
    return (span.start + padded // group).view(-1, ROW_TILE)


def _hidden(positions: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
    """[tiles, blocks, ROW_TILE, KEY_BLOCK]: key j is hidden from a row at position p when j > p."""
    keys = torch.arange(num_key_blocks * KEY_BLOCK).view(1, num_key_blocks, 1, KEY_BLOCK)
    return keys > positions.view(-1, 1, ROW_TILE, 1)


def _key_slots(span, num_key_blocks: int, device) -> torch.Tensor:
    """Pool slots of a span's keys, padded to whole blocks with its last key (finite, masked)."""
    keys = torch.arange(num_key_blocks * KEY_BLOCK).clamp(max=span.end - 1)
    return (span.base + keys).to(device)


def tiled_attention(
    q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, plan: TiledPlan, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] (rotated); pool_*: [Hkv, slots, D] already holding the spans' keys. Returns [T, Hq*D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = pool_k.shape[0]
    group = plan.group
    out = torch.empty(num_tokens * num_heads, head_dim, dtype=q.dtype, device=q.device)
    batch = plan.short_batch(num_kv_heads)
    if batch is not None:
        rows = torch.cat([q.reshape(-1, head_dim), q.new_zeros(1, head_dim)])
        tiles = rows.index_select(0, batch.q_index).view(batch.num_entries, ROW_TILE, head_dim)
        index = batch.key_rows
        shape = (batch.num_entries, batch.num_blocks, KEY_BLOCK, head_dim)
        keys = pool_k.reshape(-1, head_dim).index_select(0, index).view(shape)
        values = _with_ones(pool_v.reshape(-1, head_dim).index_select(0, index)).view(*shape[:3], -1)
        result = _attend(tiles, keys, values, batch.hidden, scale).view(-1, head_dim)
        out.index_copy_(0, batch.out_rows, result.index_select(0, batch.real_rows))
    out = out.view(num_tokens, num_heads, head_dim)
    for span in plan.long:
        rows = span.length * group
        hidden, slots = plan._long_hidden[span.offset], plan._long_keys[span.offset]
        blocks = hidden.shape[1]
        for head in range(num_kv_heads):
            heads = slice(head * group, (head + 1) * group)
            tiles = q[span.offset : span.offset + span.length, heads].reshape(rows, head_dim)
            tiles = torch.cat([tiles, tiles.new_zeros(hidden.shape[0] * ROW_TILE - rows, head_dim)])
            tiles = tiles.view(-1, ROW_TILE, head_dim)
            # One copy of the span's keys, shared by every tile (stride 0).
            shape = (tiles.shape[0], blocks, KEY_BLOCK, head_dim)
            keys = pool_k[head].index_select(0, slots).view(1, *shape[1:]).expand(shape)
            values = _with_ones(pool_v[head].index_select(0, slots)).view(1, *shape[1:3], -1)
            values = values.expand(*shape[:3], -1)
            result = _attend(tiles, keys, values, hidden, scale).view(-1, head_dim)[:rows]
            out[span.offset : span.offset + span.length, heads] = result.view(span.length, group, head_dim)
    return out.reshape(num_tokens, num_heads * head_dim)


def _with_ones(values: torch.Tensor) -> torch.Tensor:
    """[N, D] -> [N, D + 1]: a column of ones, whose weighted sum is the softmax's denominator."""
    return torch.cat([values, values.new_ones(values.shape[0], 1)], dim=1)


def _attend(
    tiles: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, scale: float
) -> torch.Tensor:
    """tiles [E, ROW_TILE, D]; keys [E, nb, KEY_BLOCK, D]; values [E, nb, KEY_BLOCK, D + 1] (_with_ones);
    hidden [E, nb, ROW_TILE, KEY_BLOCK]. Returns [E, ROW_TILE, D] in the values' dtype.
    """
    num_key_blocks = keys.shape[1]
    scores = torch.stack(
        [torch.bmm(tiles, keys[:, b].transpose(1, 2)) for b in range(num_key_blocks)], dim=1
    ).float()  # [E, nb, ROW_TILE, KEY_BLOCK]
    scores = (scores * scale).masked_fill(hidden, float("-inf"))
    top = scores.amax(dim=(1, 3), keepdim=True)  # order-free; every row sees at least key 0
    weights = torch.exp(scores - top).to(values.dtype)
    total = torch.bmm(weights[:, 0], values[:, 0]).float()  # [E, ROW_TILE, D + 1]
    for b in range(1, num_key_blocks):  # block order, float32
        total += torch.bmm(weights[:, b], values[:, b])
    return (total[..., :-1] / total[..., -1:]).to(values.dtype)

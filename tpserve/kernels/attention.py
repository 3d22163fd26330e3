"""Attention of packed spans over the KV pool, read through each stream's block table.

The pool holds KV in blocks of block_size consecutive slots (tpserve/ranks/kv_store.py: block b is slots
b*block_size .. (b+1)*block_size - 1 of every head); a span's block table names, in position order,
the blocks holding its positions, so position p lives at slot
blocks[p // block_size] * block_size + p % block_size. Every kernel reads a span's keys in position
order through its table, so the table changes which memory is read, never a bit of the result.

The fused kernel (SDPA) computes a span at a time over exactly its own keys, so no stream sees
another's; but it blocks rows and keys by the pass's shape, so a row's rounding changes with the
batch. Batch-invariant mode uses tpserve/kernels/native_attention.py or tpserve/kernels/tiled_attention.py
instead.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SpanView:
    """One stream's tokens in a packed batch.

    offset: first row of the span in the packed tensors; start: position of the span's first token;
    length: number of tokens in the span; blocks: the stream's block table, the KV block ids holding
    positions 0..end-1 in order (at least ceil(end / block_size) of them; more are ignored); images:
    (first, end) position ranges of images whose rows see each other's keys (Gemma 3's bidirectional
    image tokens: a row inside one also sees its later keys), each wholly inside the span, since a
    row cannot see keys not yet written: a pass never cuts such an image. () for every other family.
    """

    offset: int
    start: int
    length: int
    blocks: tuple[int, ...]
    images: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        for first, end in self.images:
            if not self.start <= first < end <= self.end:
                raise ValueError(
                    f"an image at positions {first}..{end - 1} is not inside the span's "
                    f"{self.start}..{self.end - 1}: a pass may not cut an image"
                )

    @property
    def end(self) -> int:  # one past the span's last position
        return self.start + self.length

    def table(self, block_size: int) -> tuple[int, ...]:
        """The blocks holding positions 0..end-1: the first ceil(end / block_size) of the table."""
        needed = -(-self.end // block_size)
        if len(self.blocks) < needed:
            raise ValueError(
                f"a span ending at position {self.end} needs {needed} blocks of {block_size} tokens; "
                f"its table has {len(self.blocks)}"
            )
        return self.blocks[:needed]


class BlockTables:
    """A pass's block tables, checked against a pool of num_slots slots (a kernel reads and writes the
    slots they name with no check of its own), in one int64 tensor on the CPU: span i's blocks are
    flat[first[i] : first[i] + ceil(end / block_size)]."""

    def __init__(self, spans, block_size: int, num_slots: int):
        self.block_size = block_size
        self.ends = [span.end for span in spans]
        self.first: list[int] = []
        ids = array("q")  # the tables gathered at C speed: a table may hold thousands of blocks
        for span in spans:
            self.first.append(len(ids))
            ids.extend(span.table(block_size))
        self.flat = torch.frombuffer(ids, dtype=torch.int64) if ids else torch.zeros(0, dtype=torch.int64)
        num_blocks = num_slots // block_size
        if ids and (int(self.flat.min()) < 0 or int(self.flat.max()) >= num_blocks):
            raise ValueError(f"a span's table names a block outside the pool's {num_blocks}")

    def slots(self, spans: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Slots of positions [S, L] (each below its span's end) of spans [S] (their indices): [S, L]."""
        first = torch.tensor([self.first[i] for i in spans], dtype=torch.int64).unsqueeze(1)
        return self.flat[first + positions // self.block_size] * self.block_size + positions % self.block_size

    def key_slots(self, spans: list[int], width: int, first_keys: list[int] | None = None) -> torch.Tensor:
        """[S, width] slots of the keys 0..end-1 of spans [S] (their indices) in position order (from
        first_keys[s], where given), each row padded past its span's end with its last key's slot."""
        ends = torch.tensor([self.ends[i] for i in spans]).unsqueeze(1)
        positions = (
            torch.arange(width)
            if first_keys is None
            else torch.arange(width) + torch.tensor(first_keys).unsqueeze(1)
        )
        return self.slots(spans, torch.minimum(positions, ends - 1))


def kv_slots(spans, block_size: int, device) -> torch.Tensor:
    """[T] pool slot of every packed token, in row order (for write_kv): built once per pass."""
    slots = array(
        "q",
        (
            span.blocks[position // block_size] * block_size + position % block_size
            for span in spans
            for position in range(span.start, span.end)
        ),
    )
    return (
        torch.frombuffer(slots, dtype=torch.int64).clone().to(device)
        if slots
        else torch.zeros(0, dtype=torch.int64, device=device)
    )


def write_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots) -> None:
    # pool_*: [Hkv, room, D]; k, v: [T, Hkv, D]; slots: [T] (kv_slots)
    # (a float16 pool beside float32 rows: rounded to nearest, as attention.c's stores round)
    pool_k.index_copy_(1, slots, k.transpose(0, 1).to(pool_k.dtype))
    pool_v.index_copy_(1, slots, v.transpose(0, 1).to(pool_v.dtype))


class SpanPlan:
    """Each span's keys as span_attention reads them: a slice of the pool's slots where its table's
    blocks lie side by side (no copy: the layout before block tables, and the interim engine's), else
    an index of its slots [end] on the device, gathered once per layer.

    A paged kernel can take the same tables: FlashInfer's paged wrappers want K and V as [num_pages,
    Hkv, page_size, D] (kv_layout "HND") with the tables as CSR (kv_indptr, kv_indices: the tables
    concatenated, kv_last_page_len); a layer's pool [Hkv, num_blocks * block_size, D] is that, seen
    as .view(Hkv, num_blocks, block_size, D).transpose(0, 1) (pages stride block_size * D, heads
    num_slots * D: a strided view, which the kernel must accept, or the pool be allocated pages
    first). flash-attn's flash_attn_with_kvcache wants [num_blocks, block_size, Hkv, D] (heads
    innermost) and block_table [num_spans, max_blocks] int32.
    """

    def __init__(self, spans, num_slots: int, block_size: int, device):
        self.spans = spans
        tables = BlockTables(spans, block_size, num_slots)
        # per span: a slice of slots, or its [end] slots (a row of one gathered index, one copy to
        # the device for the pass)
        self.keys: list[slice | torch.Tensor] = []
        scattered = []
        for index, span in enumerate(spans):
            table = span.table(block_size)
            if table == tuple(range(table[0], table[0] + len(table))):
                self.keys.append(slice(table[0] * block_size, table[0] * block_size + span.end))
            else:
                self.keys.append(index)
                scattered.append(index)
        if scattered:
            width = max(spans[i].end for i in scattered)
            slots = tables.key_slots(scattered, width).to(device)
            for row, index in enumerate(scattered):
                self.keys[index] = slots[row, : spans[index].end]


def span_attention(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    plan: SpanPlan,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
):
    """q: [T, Hq, D] (rotated); pool_*: [Hkv, room, D] already holding the spans' keys. Returns [T, Hq*D].
    window: a row at position p sees keys p - window + 1 .. p (0: all of 0 .. p), the keys before
    the span's first window never read, and a row inside one of the span's images its image's
    later keys too; sinks: [Hq] logits in each row's softmax denominator."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for span, keys in zip(plan.spans, plan.keys):
        rows = slice(span.offset, span.offset + span.length)
        first = first_key(span.start, window)  # the span's first key in any window
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ks = _keys(pool_k, keys, first).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
        vs = _keys(pool_v, keys, first).unsqueeze(0).to(q.dtype)
        if sinks is not None:
            o = _with_sinks(qs, ks, vs, scale, _visible(span, first, window, q.device), sinks)
        elif span.images or (window and span.end > window):  # a window that binds, or images: a mask
            # (the math kernel on CUDA)
            mask = _visible(span, first, window, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True, **causal(span))
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)


def last_keys(span: SpanView, positions: torch.Tensor) -> torch.Tensor:
    """The last key each row at `positions` (of `span`) sees: its own position, or the last of the
    image holding it (SpanView.images). The window's lower edge does not move: transformers' sliding
    mask for Gemma 3 is AND(window, OR(causal, image))."""
    if not span.images:
        return positions
    last = positions.clone()
    for first, end in span.images:
        last[(positions >= first) & (positions < end)] = end - 1
    return last


def first_key(position: int, window: int) -> int:
    """The first key a row at `position` sees in a layer of `window` (0: none, key 0)."""
    return max(0, position + 1 - window) if window else 0


def _visible(span: SpanView, first: int, window: int, device) -> torch.Tensor:
    """[length, end - first] bool: query i (position start + i) sees key first + j."""
    positions = torch.arange(span.start, span.end, device=device).unsqueeze(1)
    keys = torch.arange(first, span.end, device=device).unsqueeze(0)
    seen = keys <= last_keys(span, positions)
    return seen & (keys > positions - window) if window else seen


def _with_sinks(qs, ks, vs, scale: float, visible, sinks) -> torch.Tensor:
    """Attention with a sink logit per query head in the denominator (gpt-oss): the scores with one
    more column, softmaxed together, the sink's column dropped. qs [1, Hq, n, D], ks, vs [1, Hkv, L, D]."""
    group = qs.shape[1] // ks.shape[1]
    ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
    scores = (qs @ ks.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().to(scores.device).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights.to(vs.dtype) @ vs


def causal(span: SpanView) -> dict:
    """SDPA's mask arguments for a span, query i at position start+i seeing keys 0..start+i.

    Not a boolean mask: on CUDA one with enable_gqa forces PyTorch's math kernel (flash refuses
    masks, memory-efficient refuses GQA), which materialises every score. A fresh prompt is
    is_causal (upper left); a later chunk the lower-right causal bias, which torch runs on flash; a
    decode row sees every key, no mask. On the CPU each gives the boolean mask's bits."""
    if span.length == 1:
        return {}
    if span.start == 0:
        return {"is_causal": True}
    # Imported here, on the first later chunk: torch.nn.attention.bias pulls in torch._dynamo, which
    # doubles the import time of every rank that never runs this path (batch-invariant mode).
    from torch.nn.attention.bias import causal_lower_right

    return {"attn_mask": causal_lower_right(span.length, span.end)}


def _keys(pool: torch.Tensor, keys, first: int = 0) -> torch.Tensor:
    """pool [Hkv, slots, D] -> a span's keys first..end-1, [Hkv, end - first, D]."""
    if isinstance(keys, slice):
        return pool[:, keys.start + first : keys.stop]
    return pool.index_select(1, keys[first:])

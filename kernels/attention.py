"""Attention of packed spans over the KV pool: each span sees only its own lane's tokens.

Spans are computed one at a time over exactly their own keys, so a stream's numbers never depend
on what else is in the batch (no padding, no shared softmax).

With `min_rows` set (batch-invariant mode) attention is computed as plain products padded (in
rows and in keys) to the BLAS's large-batch kernel, so a row's result depends only on its own query
and keys: not on how many rows were computed with it, nor on how many keys lay beyond its position.
A decode round computes its lanes' products one lane at a time and the rest of the work once. Then a prompt
prefilled in chunks, or after a prompt-cache restore, gives the very numbers of a whole prefill,
and the first token of a prefill matches a decode step's. The fused kernel (`min_rows` 0) blocks
rows and keys by the pass's shape, and rounds differently for each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KEY_BLOCK = 256  # keys summed per product in invariant attention


@dataclass(frozen=True)
class SpanView:
    """One stream's tokens in a packed batch.

    offset: first row of the span in the packed tensors; base: the lane's first slot in the KV pool;
    start: position of the span's first token; length: number of tokens in the span.
    """

    offset: int
    base: int
    start: int
    length: int

    @property
    def end(self) -> int:  # one past the span's last position
        return self.start + self.length


def write_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans) -> None:
    # pool_*: [Hkv, room, D]; k, v: [T, Hkv, D]
    for span in spans:
        rows = slice(span.offset, span.offset + span.length)
        slots = slice(span.base + span.start, span.base + span.end)
        pool_k[:, slots] = k[rows].transpose(0, 1)
        pool_v[:, slots] = v[rows].transpose(0, 1)


def span_attention(
    q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, spans, scale: float, min_rows: int = 0
) -> torch.Tensor:
    """q: [T, Hq, D] (rotated); pool_*: [Hkv, room, D] already holding the spans' keys. Returns [T, Hq*D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if min_rows:
        steps = [span for span in spans if span.length == 1]
        if len(steps) >= 2:  # a decode round: every lane's one query in the same products
            rows = torch.tensor([span.offset for span in steps], device=q.device)
            out[rows] = invariant_step_attention(q[rows], pool_k, pool_v, steps, scale, min_rows)
            spans = [span for span in spans if span.length != 1]
    for span in spans:
        rows = slice(span.offset, span.offset + span.length)
        keys = slice(span.base, span.base + span.end)
        if min_rows:
            out[rows] = invariant_attention(
                q[rows], pool_k[:, keys], pool_v[:, keys], span.start, scale, min_rows
            )
            continue
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ks = pool_k[:, keys].unsqueeze(0)  # [1, Hkv, L, D]
        vs = pool_v[:, keys].unsqueeze(0)
        mask = None
        if span.length > 1:
            # Query i sits at position start+i and sees keys 0..start+i.
            key_pos = torch.arange(span.end, device=q.device)
            query_pos = torch.arange(span.start, span.end, device=q.device).unsqueeze(1)
            mask = key_pos <= query_pos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)


def invariant_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float, min_rows: int
) -> torch.Tensor:
    """q: [n, Hq, D] at positions start..start+n-1; keys, values: [Hkv, L, D], L >= start+n.

    Returns [n, Hq, D]. Query heads are grouped under their KV head (head h reads KV head h // g),
    and the positions are padded so each product has at least min_rows rows.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = keys.shape[0], keys.shape[1]
    if num_keys < min_rows:
        # The BLAS also picks its kernel by the number of keys: fewer than min_rows rounds
        # differently, so a row near the start would change with the keys after it. Zero keys,
        # masked below, make the products their large-batch shape.
        keys, values = (F.pad(t, (0, 0, 0, min_rows - num_keys)) for t in (keys, values))
        num_keys = min_rows
    group = num_heads // num_kv_heads
    padded = max(num_rows, -(-min_rows // group))
    grouped = q.reshape(num_rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
    grouped = F.pad(grouped, (0, 0, 0, padded - num_rows)).reshape(num_kv_heads, group * padded, head_dim)
    scores = torch.matmul(grouped, keys.transpose(1, 2)).float() * scale  # [Hkv, g*rows, L]
    # Padding rows sit at the last real position, so no row is wholly masked.
    positions = (start + torch.arange(padded, device=q.device)).clamp(max=start + num_rows - 1)
    hidden = torch.arange(num_keys, device=q.device) > positions.unsqueeze(1)  # [rows, L]
    scores = scores.view(num_kv_heads, group, padded, num_keys).masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(num_kv_heads, group * padded, num_keys)
    out = _weigh_values(probs, values)  # [Hkv, g*rows, D]
    out = out.view(num_kv_heads, group, padded, head_dim)[:, :, :num_rows]
    return out.permute(2, 0, 1, 3).reshape(num_rows, num_heads, head_dim)


def invariant_step_attention(
    q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, spans, scale: float, min_rows: int
) -> torch.Tensor:
    """q: [S, Hq, D], span s's one query at position spans[s].start; pool_*: [Hkv, room, D].

    Returns [S, Hq, D]: for each span the very numbers invariant_attention gives it alone. The
    products are that function's, span by span, on views of the pool; what is shared is the work
    around them (padding the queries, masking, the softmax), which for one query per span would
    otherwise cost more than the products. A shorter span's row of scores ends in masked keys, which
    the softmax weighs zero exactly.
    """
    num_spans, num_heads, head_dim = q.shape
    num_kv_heads = pool_k.shape[0]
    group = num_heads // num_kv_heads
    padded = -(-min_rows // group)
    ends = [max(span.end, min_rows) for span in spans]  # at least min_rows keys: see invariant_attention
    num_keys = max(ends)
    grouped = F.pad(q.reshape(num_spans, num_kv_heads, group, 1, head_dim), (0, 0, 0, padded - 1))
    grouped = grouped.reshape(num_spans, num_kv_heads, group * padded, head_dim)
    # float32, as invariant_attention's; past a span's keys its row stays -inf, weighed zero.
    scores = torch.full((num_spans, num_kv_heads, group * padded, num_keys), float("-inf"), device=q.device)
    for i, (span, end) in enumerate(zip(spans, ends)):
        keys = _keys_of(pool_k, span, end)  # [Hkv, end, D]
        scores[i, :, :, :end] = torch.matmul(grouped[i], keys.transpose(1, 2))
        if end > span.start + 1:  # keys padded to min_rows lie past the query's position
            scores[i, :, :, span.start + 1 : end] = float("-inf")
    scores.mul_(scale)  # elementwise, so the same bits as scaling each span's scores alone
    probs = torch.softmax(scores, dim=-1).to(pool_v.dtype)
    out = torch.empty(num_spans, num_kv_heads, group * padded, head_dim, dtype=q.dtype, device=q.device)
    for i, (span, end) in enumerate(zip(spans, ends)):
        values = _keys_of(pool_v, span, end)
        out[i] = _weigh_values(probs[i, ..., :end], values)
    out = out.view(num_spans, num_kv_heads, group, padded, head_dim)[:, :, :, 0]
    return out.reshape(num_spans, num_heads, head_dim)


def _weigh_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [H, rows, L] @ values [H, L, D], summed over keys in fixed KEY_BLOCK blocks in order.

    The BLAS splits a long sum over keys by its length; fixed blocks keep a row's rounding the same
    however many (masked, zero-weight) keys follow its position.
    """
    num_keys = probs.shape[-1]
    out = torch.matmul(probs[..., :KEY_BLOCK], values[:, :KEY_BLOCK])
    for first in range(KEY_BLOCK, num_keys, KEY_BLOCK):
        out = out + torch.matmul(probs[..., first : first + KEY_BLOCK], values[:, first : first + KEY_BLOCK])
    return out


def _keys_of(pool: torch.Tensor, span: SpanView, num_keys: int) -> torch.Tensor:
    """The span's first num_keys slots of the pool ([Hkv, num_keys, D]), zeros past the lane's
    written ones when num_keys exceeds them (a span shorter than min_rows)."""
    if num_keys == span.end:
        return pool[:, span.base : span.base + span.end]
    return F.pad(pool[:, span.base : span.base + span.end], (0, 0, 0, num_keys - span.end))

"""Attention of packed spans over the KV pool: each span sees only its own lane's tokens.

Spans are computed one at a time over exactly their own keys, so a stream's numbers never depend
on what else is in the batch (no padding, no shared softmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    # pool_*: [room, Hkv, D]; k, v: [T, Hkv, D]
    for span in spans:
        rows = slice(span.offset, span.offset + span.length)
        slots = slice(span.base + span.start, span.base + span.end)
        pool_k[slots] = k[rows]
        pool_v[slots] = v[rows]


def span_attention(
    q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, spans, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] (rotated); pool_*: [room, Hkv, D] already holding the spans' keys. Returns [T, Hq*D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for span in spans:
        rows = slice(span.offset, span.offset + span.length)
        keys = slice(span.base, span.base + span.end)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ks = pool_k[keys].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vs = pool_v[keys].transpose(0, 1).unsqueeze(0)
        mask = None
        if span.length > 1:
            # Query i sits at position start+i and sees keys 0..start+i.
            key_pos = torch.arange(span.end, device=q.device)
            query_pos = torch.arange(span.start, span.end, device=q.device).unsqueeze(1)
            mask = key_pos <= query_pos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)

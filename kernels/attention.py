"""Attention of packed spans over the KV pool: each span sees only its own lane's tokens.

The fused kernel (SDPA) computes a span at a time over exactly its own keys, so no stream sees
another's; but it blocks rows and keys by the pass's shape, so a row's rounding changes with the
batch. Batch-invariant mode uses kernels/tiled_attention.py instead, where every product has one
fixed shape.
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


def kv_slots(spans, device) -> torch.Tensor:
    """[T] pool slot of every packed token, in row order: built once per pass."""
    slots = [span.base + position for span in spans for position in range(span.start, span.end)]
    return torch.tensor(slots, dtype=torch.int64, device=device)


def write_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots) -> None:
    # pool_*: [Hkv, room, D]; k, v: [T, Hkv, D]; slots: [T] (kv_slots)
    # (a float16 pool beside float32 rows: rounded to nearest, as attention.c's stores round)
    pool_k.index_copy_(1, slots, k.transpose(0, 1).to(pool_k.dtype))
    pool_v.index_copy_(1, slots, v.transpose(0, 1).to(pool_v.dtype))


def span_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, spans, scale: float):
    """q: [T, Hq, D] (rotated); pool_*: [Hkv, room, D] already holding the spans' keys. Returns [T, Hq*D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for span in spans:
        rows = slice(span.offset, span.offset + span.length)
        keys = slice(span.base, span.base + span.end)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ks = pool_k[:, keys].unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
        vs = pool_v[:, keys].unsqueeze(0).to(q.dtype)
        mask = None
        if span.length > 1:
            # Query i sits at position start+i and sees keys 0..start+i.
            key_pos = torch.arange(span.end, device=q.device)
            query_pos = torch.arange(span.start, span.end, device=q.device).unsqueeze(1)
            mask = key_pos <= query_pos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)

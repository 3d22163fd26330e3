"""Batch-invariant attention: a row's output depends on its own query and keys only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.kernels.attention import SpanView, invariant_attention, span_attention

NUM_KEYS = 700


@pytest.fixture(scope="module")
def qkv():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(NUM_KEYS, h, 64, generator=gen) for h in (6, 2, 2))


def test_matches_the_reference_attention(qkv):
    q, k, v = qkv
    ours = invariant_attention(q, k, v, 0, 0.125, 16)
    mask = torch.arange(NUM_KEYS) <= torch.arange(NUM_KEYS).unsqueeze(1)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.125, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("start", "num_rows"), [(0, 1), (100, 1), (100, 5), (100, 33), (37, 64), (512, 188), (699, 1)]
)
def test_rows_equal_the_whole_prefill_bit_for_bit(qkv, start, num_rows):
    # A chunk, a prompt after a cache restore, a decode step: the same numbers as one whole pass.
    q, k, v = qkv
    whole = invariant_attention(q, k, v, 0, 0.125, 16)
    end = start + num_rows
    part = invariant_attention(q[start:end], k[:end], v[:end], start, 0.125, 16)
    assert torch.equal(part, whole[start:end])


def test_span_attention_reads_each_span_from_its_own_lane(qkv):
    q, k, v = qkv
    pool_k = torch.cat([k[:300], torch.randn(100, 2, 64), k[:300]])
    pool_v = torch.cat([v[:300], torch.randn(100, 2, 64), v[:300]])
    spans = [SpanView(0, 0, 290, 10), SpanView(10, 400, 290, 10)]
    out = span_attention(torch.cat([q[290:300], q[290:300]]), pool_k, pool_v, spans, 0.125, 16)
    assert torch.equal(out[:10], out[10:])

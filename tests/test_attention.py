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
    q, k, v = (torch.randn(NUM_KEYS, h, 64, generator=gen) for h in (6, 2, 2))
    return (
        q,
        k.transpose(0, 1).contiguous(),
        v.transpose(0, 1).contiguous(),
    )  # keys head-major, as in the pool


def test_matches_the_reference_attention(qkv):
    q, k, v = qkv
    ours = invariant_attention(q, k, v, 0, 0.125, 16)
    mask = torch.arange(NUM_KEYS) <= torch.arange(NUM_KEYS).unsqueeze(1)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, scale=0.125, enable_gqa=True
    )
    ref = ref.transpose(0, 1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("start", "num_rows"),
    [(0, 1), (100, 1), (100, 5), (100, 33), (37, 64), (512, 188), (699, 1)]
    + [(start, num_rows) for start in range(1, 20) for num_rows in (1, 3)],  # fewer than 16 keys
)
def test_rows_equal_the_whole_prefill_bit_for_bit(qkv, start, num_rows):
    # A chunk, a prompt after a cache restore, a decode step: the same numbers as one whole pass;
    # near the start too (a short prompt's decode steps, its re-prefill after yielding its lane).
    q, k, v = qkv
    whole = invariant_attention(q, k, v, 0, 0.125, 16)
    end = start + num_rows
    part = invariant_attention(q[start:end], k[:, :end], v[:, :end], start, 0.125, 16)
    assert torch.equal(part, whole[start:end])


def test_span_attention_reads_each_span_from_its_own_lane(qkv):
    q, k, v = qkv
    pool_k = torch.cat([k[:, :300], torch.randn(2, 100, 64), k[:, :300]], dim=1)
    pool_v = torch.cat([v[:, :300], torch.randn(2, 100, 64), v[:, :300]], dim=1)
    spans = [SpanView(0, 0, 290, 10), SpanView(10, 400, 290, 10)]
    out = span_attention(torch.cat([q[290:300], q[290:300]]), pool_k, pool_v, spans, 0.125, 16)
    assert torch.equal(out[:10], out[10:])


def test_a_decode_round_equals_each_lane_alone_and_the_whole_prefill(qkv):
    # Lanes at different lengths in one round: each row as if computed alone, bit for bit, and as
    # in the whole prefill.
    q, k, v = qkv
    whole = invariant_attention(q, k, v, 0, 0.125, 16)
    lengths = [1, 17, 300, 699, 64, 6, 256, 257]
    pool_k = torch.cat([k] * len(lengths), dim=1)
    pool_v = torch.cat([v] * len(lengths), dim=1)
    steps = [SpanView(i, i * 700, n - 1, 1) for i, n in enumerate(lengths)]
    queries = torch.stack([q[n - 1] for n in lengths])
    together = span_attention(queries, pool_k, pool_v, steps, 0.125, 16)
    for i, n in enumerate(lengths):
        alone = span_attention(
            queries[i : i + 1], pool_k, pool_v, [SpanView(0, i * 700, n - 1, 1)], 0.125, 16
        )
        assert torch.equal(together[i], alone[0])
        assert torch.equal(together[i].view(6, 64), whole[n - 1])


@pytest.mark.parametrize("num_keys", [400, 700, 1100])
def test_long_rows_equal_the_whole_prefill_bit_for_bit(num_keys):
    # Past a few hundred keys the BLAS splits the sum over keys by its length; rows must not care.
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(num_keys, 6, 64, generator=gen)
    k, v = (torch.randn(2, num_keys, 64, generator=gen) for _ in range(2))
    whole = invariant_attention(q, k, v, 0, 0.125, 16)
    cuts = [
        (0, 300),
        (300, num_keys - 300),
        (num_keys - 1, 1),
        (num_keys - 40, 40),
        (num_keys // 2, 17),
        (128, 256),
    ]
    for start, num_rows in cuts:
        end = start + num_rows
        part = invariant_attention(q[start:end], k[:, :end], v[:, :end], start, 0.125, 16)
        assert torch.equal(part, whole[start:end]), (start, num_rows)

"""The paged kernel's tables (tpserve/kernels/paged_attention.py): the CSR arrays FlashInfer reads are built
from the engine's block tables, and gathering pages by them gives each stream's keys in position
order; the kernel's SDPA fallback through those arrays gives span_attention's bits, alone and in
the model's own passes. FlashInfer itself runs only on a GPU (bench/gpu_check.py checks it there)."""

from __future__ import annotations

import pytest
import torch
from test_block_tables import GROUP, PARTS, SCALE, packed, paged, streams
from tiny_models import write_tiny_model

from tpserve.kernels.attention import SpanView
from tpserve.kernels.attention_kernels import (
    FALLBACK_ORDER,
    SPANS,
    attention_choice,
    choose_attention,
    paged_kernel,
)
from tpserve.kernels.paged_attention import PagedPlan, gather_keys, paged_tables, pages_of
from tpserve.ranks.engine import Engine, open_lane
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

FALLBACK = paged_kernel(None)


def test_csr_arrays_of_a_pass():
    # block size 8: a decode row at position 16 (3 pages, 1 key in the last), a chunk of 5 from 3
    # (1 page of 8), a fresh prompt of 9 (2 pages, 1 in the last)
    spans = [SpanView(0, 16, 1, (4, 0, 6, 9)), SpanView(1, 3, 5, (2,)), SpanView(6, 0, 9, (7, 1))]
    tables = paged_tables(spans, 8, 80)
    assert tables.qo_indptr.tolist() == [0, 1, 6, 15]
    assert tables.kv_indptr.tolist() == [0, 3, 4, 6]
    assert tables.kv_indices.tolist() == [4, 0, 6, 2, 7, 1]  # the entry past a span's end left out
    assert tables.kv_last_page_len.tolist() == [1, 8, 1]
    assert {t.dtype for t in (tables.qo_indptr, tables.kv_indptr, tables.kv_indices)} == {torch.int32}
    with pytest.raises(ValueError, match="outside the pool's 8"):
        paged_tables([SpanView(0, 0, 3, (8,))], 8, 64)


@pytest.mark.parametrize("block_size", [1, 16, 24, 32])
def test_pages_gathered_by_the_csr_arrays_are_each_streams_keys_in_order(block_size):
    _, ks, vs, gen = streams(PARTS, torch.float32, seed=block_size)
    pool_k, _, tables = paged(ks, vs, block_size, gen)
    csr = paged_tables(packed(PARTS, tables), block_size, pool_k.shape[1])
    for index, keys in enumerate(ks):
        assert torch.equal(gather_keys(pool_k, csr, index), keys), PARTS[index]
    # the HND view is the pool itself: page b, head h, slot s is pool[h, b * block_size + s]
    pages = pages_of(pool_k, block_size)
    block = tables[-1][0]  # the long prefill's first block: full
    assert pages.shape[1:] == (pool_k.shape[0], block_size, pool_k.shape[2])
    assert pages.data_ptr() == pool_k.data_ptr()
    assert torch.equal(pages[block, 1], pool_k[1, block * block_size : (block + 1) * block_size])


def test_engine_tables_read_through_the_csr_arrays():
    # The blocks an engine's lanes hold (open_lane, then the blocks a round adds) as the pass's
    # SpanViews carry them: the arrays name exactly those, in order.
    pool = KVPool(1, 20 * 4, [1], 8, torch.float32, block_size=4)
    engine = Engine(model=None, kv=pool)
    first = open_lane(engine, 0, 10)  # blocks 0, 1, 2
    second = open_lane(engine, 1, 3)  # block 3
    engine.lanes[0].blocks.append(7)
    spans = [
        SpanView(0, 10, 3, tuple(engine.lanes[0].blocks)),
        SpanView(3, 3, 1, tuple(engine.lanes[1].blocks)),
    ]
    tables = paged_tables(spans, 4, pool.num_slots)
    assert tables.kv_indices.tolist() == [*first, 7, *second]
    assert tables.kv_last_page_len.tolist() == [1, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_the_fallback_through_pages_gives_span_attentions_bits(dtype):
    qs, ks, vs, gen = streams(PARTS, dtype, seed=5)
    pool_k, pool_v, tables = paged(ks, vs, 16, gen)
    spans = packed(PARTS, tables)
    q = torch.cat(qs)
    ours = FALLBACK.attend(q, pool_k, pool_v, FALLBACK.plan(spans, GROUP, pool_k.shape[1], 16, "cpu"), SCALE)
    theirs = SPANS.attend(q, pool_k, pool_v, SPANS.plan(spans, GROUP, pool_k.shape[1], 16, "cpu"), SCALE)
    assert torch.isfinite(ours).all() and torch.equal(ours, theirs)
    # padding rows past the spans' tokens come back zero, the real rows unchanged
    padded = FALLBACK.attend(
        torch.cat([q, q[:3]]), pool_k, pool_v, PagedPlan(spans, pool_k.shape[1], 16, "cpu"), SCALE
    )
    assert torch.equal(padded[: q.shape[0]], ours) and not padded[q.shape[0] :].any()


def test_no_gpu_no_flashinfer_the_cpu_keeps_its_kernels():
    assert choose_attention(False, 64, 4, torch.bfloat16, "cpu") is SPANS


def test_the_fallback_order_flashinfer_then_sdpa():
    assert FALLBACK_ORDER == ("flashinfer", "sdpa")
    bf16, f32 = torch.bfloat16, torch.float32
    assert attention_choice(False, bf16, "cuda", has_flashinfer=True) == "flashinfer"
    assert attention_choice(False, torch.float16, "cuda", has_flashinfer=True) == "flashinfer"
    assert attention_choice(False, bf16, "cuda", has_flashinfer=False) == "sdpa"
    assert attention_choice(False, f32, "cuda", has_flashinfer=True) == "sdpa"  # FlashInfer: 16-bit only
    assert attention_choice(False, bf16, "cpu", has_flashinfer=True) == "sdpa"
    assert attention_choice(True, bf16, "cuda", has_flashinfer=True) == "invariant"


def test_the_models_passes_on_the_paged_fallback_give_the_spans_kernels_logits(tmp_path):
    model = load_rank_model(
        write_tiny_model(tmp_path / "llama", "llama"), tp_rank=0, tp_size=1, dtype=torch.float32,
        max_positions=256, row_tile=0,
    )  # fmt: skip
    cfg, block_size = model.config, 16
    order = torch.randperm(12, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [tuple(order[:6]), tuple(order[6:])]
    gen = torch.Generator().manual_seed(1)
    passes = [[(0, 0, 40), (1, 0, 25)], [(0, 40, 10), (1, 25, 1)], [(0, 50, 1), (1, 26, 1)]]
    tokens = [[torch.randint(3, cfg.vocab_size, (n,), generator=gen) for *_, n in p] for p in passes]
    logits = []
    for kernel in (SPANS, FALLBACK):
        model.attention = kernel
        pool = KVPool(cfg.num_layers, 12 * block_size, model.kv_heads_per_piece(), cfg.head_dim,
                      torch.float32, block_size=block_size)  # fmt: skip
        logits.append([])
        for spans, ids in zip(passes, tokens):
            views, offset = [], 0
            for stream, start, n in spans:
                views.append(SpanView(offset, start, n, tables[stream]))
                offset += n
            positions = torch.cat([torch.arange(start, start + n) for _, start, n in spans])
            rows = [v.offset + v.length - 1 for v in views]
            logits[-1].append(model.forward(torch.cat(ids), positions, views, pool, rows))
    assert all(torch.equal(a, b) for a, b in zip(*logits))

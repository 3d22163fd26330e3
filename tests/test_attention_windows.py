"""Sliding windows and attention sinks in every attention kernel.

A sliding-window row at position p sees keys p - window + 1 .. p (transformers' `sliding_window`,
the query's own key included); a sink (gpt-oss) is a per-head logit in the softmax's denominator.
Each kernel matches a float64 reference; the batch-invariant ones (the C kernel and the tiled
products) give a chunk or a decode step the whole prefill's bits through scattered block tables, and
the C kernel's vector paths give its plain path's bits. Keys behind every window are never read
(the tiled products': key blocks of 128 wholly behind, which skipping leaves every bit as masking
them did).
"""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels import tiled_attention
from tpserve.kernels.attention import SpanView, _visible, first_key
from tpserve.kernels.attention_kernels import NATIVE, SPANS, TILED, paged_kernel
from tpserve.kernels.native_attention import attention_paths, native_unavailable, use_attention_path

GROUP, SCALE, BLOCK = 2, 0.125, 4
NUM_KEYS, HEAD_DIM, NUM_KV_HEADS = 300, 64, 2


@pytest.fixture(params=[TILED, NATIVE, SPANS], ids=lambda kernel: kernel.name)
def kernel(request):
    if request.param is NATIVE and (why := native_unavailable(HEAD_DIM, GROUP, torch.float32, "cpu")):
        pytest.skip(why)
    return request.param


def pool_and_queries(seed: int = 0, head_dim: int = HEAD_DIM, group: int = GROUP):
    """q [NUM_KEYS, Hq, D] and a pool whose blocks of BLOCK slots hold positions 0.. in a shuffled
    order (the table), with every slot no table names full of NaN."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(NUM_KEYS, NUM_KV_HEADS * group, head_dim, generator=gen)
    k, v = (torch.randn(NUM_KV_HEADS, NUM_KEYS, head_dim, generator=gen) for _ in range(2))
    num_blocks = NUM_KEYS // BLOCK
    table = tuple((torch.randperm(num_blocks, generator=gen) + 3).tolist())  # blocks 0..2 never named
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(NUM_KEYS)])
    pool_k, pool_v = (
        torch.full((NUM_KV_HEADS, (num_blocks + 3) * BLOCK, head_dim), float("nan")) for _ in "kv"
    )
    pool_k[:, slots], pool_v[:, slots] = k, v
    return q, k, v, pool_k, pool_v, table


def reference(q, k, v, window: int, sinks=None, images=()):
    """Float64 attention of every position over keys 0.., within the window, with the sinks; images:
    (first, end) position ranges whose rows also see each other's keys, as transformers' Gemma 3
    mask: AND(window, OR(causal, same image))."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[0]
    scores = torch.einsum("thd,hjd->htj", q, k.repeat_interleave(group, dim=0)) * SCALE
    positions, keys = torch.arange(q.shape[0]).unsqueeze(1), torch.arange(k.shape[1]).unsqueeze(0)
    seen = keys <= positions
    for first, end in images:
        seen |= (positions >= first) & (positions < end) & (keys >= first) & (keys < end)
    seen &= (keys > positions - window) if window else True
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.einsum("htj,hjd->thd", weights, v.repeat_interleave(group, dim=0))


def attend(kernel, q, pool_k, pool_v, spans, window, sinks=None, group=GROUP):
    plan = kernel.plan(spans, group, pool_k.shape[1], BLOCK, "cpu", q.shape[0])
    return kernel.attend(q, pool_k, pool_v, plan, SCALE, window, sinks).view(q.shape)


def finite_pool(pool: torch.Tensor) -> torch.Tensor:
    """The tiled products read whole key blocks (masked, never NaN in a served pool): zeros for NaN."""
    return torch.nan_to_num(pool, nan=0.0)


SINKS = torch.tensor([0.5, -1.0, 2.0, 8.0])  # one per query head (4 = NUM_KV_HEADS * GROUP)


@pytest.mark.parametrize("window", [0, 1, 3, 8, 16, 100])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no-sinks", "sinks"])
def test_each_kernel_matches_the_reference(kernel, window, sinks):
    q, k, v, pool_k, pool_v, table = pool_and_queries()
    if kernel is TILED:
        pool_k, pool_v = finite_pool(pool_k), finite_pool(pool_v)
    ours = attend(kernel, q, pool_k, pool_v, [SpanView(0, 0, NUM_KEYS, table)], window, sinks)
    torch.testing.assert_close(ours.double(), reference(q, k, v, window, sinks), rtol=1e-5, atol=1e-5)


CUTS = [(0, 1), (5, 3), (7, 1), (8, 1), (9, 20), (15, 17), (16, 40), (100, 1), (128, 64), (250, 50), (299, 1)]


@pytest.mark.parametrize("window", [1, 3, 8, 16, 130])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no-sinks", "sinks"])
def test_chunks_and_decode_rows_have_the_whole_prefills_bits(kernel, window, sinks):
    if kernel is SPANS:
        pytest.skip("SDPA is not batch-invariant")
    q, _, _, pool_k, pool_v, table = pool_and_queries(seed=1)
    if kernel is TILED:
        pool_k, pool_v = finite_pool(pool_k), finite_pool(pool_v)
    whole = attend(kernel, q, pool_k, pool_v, [SpanView(0, 0, NUM_KEYS, table)], window, sinks)
    # every cut alone, then all of them in one pass beside each other
    for start, n in CUTS:
        alone = attend(
            kernel, q[start : start + n], pool_k, pool_v, [SpanView(0, start, n, table)], window, sinks
        )
        assert torch.equal(alone, whole[start : start + n]), (start, n)
    offsets = [sum(n for _, n in CUTS[:i]) for i in range(len(CUTS))]
    spans = [SpanView(offset, start, n, table) for offset, (start, n) in zip(offsets, CUTS)]
    rows = torch.cat([q[start : start + n] for start, n in CUTS])
    together = attend(kernel, rows, pool_k, pool_v, spans, window, sinks)
    assert torch.equal(together, torch.cat([whole[start : start + n] for start, n in CUTS]))


@pytest.mark.parametrize("kernel", [NATIVE, SPANS, paged_kernel(None)], ids=lambda kernel: kernel.name)
def test_keys_behind_every_window_are_never_read(kernel):
    # A decode row and a late chunk of a windowed layer: the blocks wholly behind their windows are
    # poisoned with NaN, and the rows come out as before (the kernels skip them).
    if kernel is NATIVE and (why := native_unavailable(HEAD_DIM, GROUP, torch.float32, "cpu")):
        pytest.skip(why)
    q, _, _, pool_k, pool_v, table = pool_and_queries(seed=2)
    spans = [SpanView(0, 299, 1, table), SpanView(1, 200, 30, table)]
    rows = torch.cat([q[299:300], q[200:230]])
    before = attend(kernel, rows, pool_k, pool_v, spans, 16)
    for block in table[: (200 - 16) // BLOCK]:  # behind position 200's window and so every later one
        pool_k[:, block * BLOCK : (block + 1) * BLOCK] = float("nan")
        pool_v[:, block * BLOCK : (block + 1) * BLOCK] = float("nan")
    after = attend(kernel, rows, pool_k, pool_v, spans, 16)
    assert torch.isfinite(after).all()
    assert torch.equal(after, before)


def test_the_gpu_paths_keys_start_at_the_spans_first_window_and_its_mask_is_the_window():
    # What SDPA a span at a time (the GPU path, and the paged kernel's for a binding window) is
    # given: a chunk's keys from its first row's window on, masked to each row's window.
    span = SpanView(0, 200, 30, ())
    first = first_key(span.start, 16)
    assert first == 185 and first_key(10, 16) == 0 and first_key(299, 0) == 0
    mask = _visible(span, first, 16, "cpu")  # [rows, keys first..end-1]
    positions, keys = torch.arange(200, 230).unsqueeze(1), torch.arange(first, 230).unsqueeze(0)
    assert torch.equal(mask, (keys <= positions) & (keys > positions - 16))
    assert mask[0].nonzero().flatten().tolist() == list(range(16))  # position 200: keys 185..200
    assert mask.sum(1).tolist() == [16] * 30


def test_the_tiled_products_never_read_the_key_blocks_behind_every_window():
    # Decode rows, a short chunk and a long one (more than SHORT_ROWS grouped rows) of a windowed
    # layer, all past position 128 + 16: the tiled products' first key block (keys 0..127) lies
    # wholly behind every window, and poisoned with NaN (the products would carry it into every
    # row that multiplied it) leaves the rows as they were.
    q, _, _, pool_k, pool_v, table = pool_and_queries(seed=3)
    pool_k, pool_v = finite_pool(pool_k), finite_pool(pool_v)
    cuts = [(299, 1), (160, 1), (200, 30), (150, 150)]
    offsets = [sum(n for _, n in cuts[:i]) for i in range(len(cuts))]
    spans = [SpanView(offset, start, n, table) for offset, (start, n) in zip(offsets, cuts)]
    rows = torch.cat([q[start : start + n] for start, n in cuts])
    before = attend(TILED, rows, pool_k, pool_v, spans, 16, SINKS)
    for block in table[: tiled_attention.KEY_BLOCK // BLOCK]:
        pool_k[:, block * BLOCK : (block + 1) * BLOCK] = float("nan")
        pool_v[:, block * BLOCK : (block + 1) * BLOCK] = float("nan")
    after = attend(TILED, rows, pool_k, pool_v, spans, 16, SINKS)
    assert torch.isfinite(after).all()
    assert torch.equal(after, before)


def masking_only(monkeypatch):
    """The tiled products with no key block skipped for a window: masked, as they were first built."""
    monkeypatch.setattr(
        tiled_attention, "_end_tiles", lambda positions, blocks, window: [len(positions)] * blocks
    )
    monkeypatch.setattr(tiled_attention, "_window_block", lambda start, window: 0)


@pytest.mark.parametrize("window", [1, 16, 127, 128, 129, 200])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_skipping_the_blocks_behind_a_window_gives_masking_them_bits(monkeypatch, window, sinks, dtype):
    # A whole prompt (long: tiles whose windows start past some blocks, beside tiles that see them),
    # a late long chunk, a short chunk and decode rows: every bit as with those blocks masked.
    q, _, _, pool_k, pool_v, table = pool_and_queries(seed=4)
    q, pool_k, pool_v = q.to(dtype), finite_pool(pool_k).to(dtype), finite_pool(pool_v).to(dtype)
    cuts = [(0, NUM_KEYS), (140, 160), (250, 20), (299, 1), (129, 1), (7, 1)]
    offsets = [sum(n for _, n in cuts[:i]) for i in range(len(cuts))]
    spans = [SpanView(offset, start, n, table) for offset, (start, n) in zip(offsets, cuts)]
    rows = torch.cat([q[start : start + n] for start, n in cuts])
    skipped = attend(TILED, rows, pool_k, pool_v, spans, window, sinks)
    masking_only(monkeypatch)
    masked = attend(TILED, rows, pool_k, pool_v, spans, window, sinks)
    assert torch.equal(skipped, masked)


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_the_c_kernels_vector_paths_give_its_plain_paths_bits(path, head_dim, group, half):
    if why := native_unavailable(head_dim, group, torch.float32, "cpu"):
        pytest.skip(why)
    if path not in attention_paths():
        pytest.skip(f"this CPU runs the C kernel's {attention_paths()} paths, not {path}")
    q, _, _, pool_k, pool_v, table = pool_and_queries(seed=head_dim * group, head_dim=head_dim, group=group)
    if half:
        pool_k, pool_v = pool_k.half(), pool_v.half()
    spans = [SpanView(0, 0, 37, table), SpanView(37, 260, 1, table), SpanView(38, 15, 1, table)]
    spans.append(SpanView(39, 100, 9, table))
    rows = torch.cat([q[:37], q[260:261], q[15:16], q[100:109]])
    sinks = torch.linspace(-2, 3, q.shape[1])
    for window, with_sinks in ((1, None), (2, sinks), (5, None), (16, sinks), (40, None)):
        try:
            use_attention_path(path)
            vectors = attend(NATIVE, rows, pool_k, pool_v, spans, window, with_sinks, group)
            use_attention_path("plain")
            plain = attend(NATIVE, rows, pool_k, pool_v, spans, window, with_sinks, group)
        finally:
            use_attention_path(None)
        assert torch.isfinite(plain).all()
        assert torch.equal(vectors, plain), window

"""Images whose rows see each other (Gemma 3's bidirectional image tokens) in every attention kernel.

A row inside an image span [first, end) of its stream sees that image's later keys too, in full and
sliding layers alike (transformers' mask: AND(window, OR(causal, same image))); the window's lower
edge stays where it was. Each kernel matches the float64 reference mask; the batch-invariant ones
give a chunk that ends at an image's edge, or starts inside one after a cached prefix, the whole
prefill's bits; spans that name no image keep their bits (tests/test_attention_windows.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_attention_windows import (
    GROUP,
    HEAD_DIM,
    NUM_KEYS,
    SINKS,
    attend,
    finite_pool,
    pool_and_queries,
    reference,
)
from tpserve.kernels.attention import SpanView
from tpserve.kernels.attention_kernels import NATIVE, SPANS, TILED, paged_kernel
from tpserve.kernels.native_attention import attention_paths, native_unavailable, use_attention_path

# A one-token image, a short one, one crossing the tiled products' key block of 128 and longer than
# most windows below
IMAGES = ((10, 11), (20, 52), (100, 240))


@pytest.fixture(params=[TILED, NATIVE, SPANS, paged_kernel(None)], ids=lambda kernel: kernel.name)
def kernel(request):
    if request.param is NATIVE and (why := native_unavailable(HEAD_DIM, GROUP, torch.float32, "cpu")):
        pytest.skip(why)
    return request.param


def pools_for(kernel, seed: int):
    q, k, v, pool_k, pool_v, table = pool_and_queries(seed)
    if kernel is TILED:
        pool_k, pool_v = finite_pool(pool_k), finite_pool(pool_v)
    return q, k, v, pool_k, pool_v, table


@pytest.mark.parametrize("window", [0, 1, 8, 64, 1000])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no-sinks", "sinks"])
def test_each_kernel_matches_the_reference_mask_with_images(kernel, window, sinks):
    q, k, v, pool_k, pool_v, table = pools_for(kernel, seed=3)
    ours = attend(kernel, q, pool_k, pool_v, [SpanView(0, 0, NUM_KEYS, table, IMAGES)], window, sinks)
    expected = reference(q, k, v, window, sinks, IMAGES)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)
    plain = attend(kernel, q, pool_k, pool_v, [SpanView(0, 0, NUM_KEYS, table)], window, sinks)
    assert not torch.equal(ours[20:52], plain[20:52])  # the images' rows did see later keys


@pytest.mark.parametrize("window", [0, 8])
def test_short_spans_batched_together_see_their_own_images(kernel, window):
    # Short spans (the tiled products' batch), one of them an image after a cached prefix: each row
    # as the reference's rows at the same positions, whose image began earlier.
    q, k, v, pool_k, pool_v, table = pools_for(kernel, seed=4)
    spans = [
        SpanView(0, 20, 12, table, ((20, 32),)),
        SpanView(12, 60, 1, table),
        SpanView(13, 8, 5, table, ((10, 11),)),
    ]
    rows = torch.cat([q[20:32], q[60:61], q[8:13]])
    ours = attend(kernel, rows, pool_k, pool_v, spans, window)
    expected = reference(q, k, v, window, None, ((10, 11), (15, 32)))
    expected = torch.cat([expected[20:32], expected[60:61], expected[8:13]])
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)


def images_in(start: int, length: int):
    """The parts of IMAGES inside positions start .. start + length - 1 (a chunk may begin inside an
    image, after a cached prefix, but never end inside one)."""
    return tuple((max(first, start), end) for first, end in IMAGES if start < end and first < start + length)


CUTS = [(0, 10), (10, 1), (11, 41), (52, 48), (100, 140), (120, 120), (150, 90), (240, 1), (241, 59)]


@pytest.mark.parametrize("window", [0, 8, 130])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no-sinks", "sinks"])
def test_chunks_that_keep_images_whole_have_the_whole_prefills_bits(kernel, window, sinks):
    if kernel.name in ("spans", "paged-sdpa"):
        pytest.skip("SDPA is not batch-invariant")
    q, _, _, pool_k, pool_v, table = pools_for(kernel, seed=5)
    whole = attend(kernel, q, pool_k, pool_v, [SpanView(0, 0, NUM_KEYS, table, IMAGES)], window, sinks)
    for start, n in CUTS:
        span = SpanView(0, start, n, table, images_in(start, n))
        alone = attend(kernel, q[start : start + n], pool_k, pool_v, [span], window, sinks)
        assert torch.equal(alone, whole[start : start + n]), (start, n)
    offsets = [sum(n for _, n in CUTS[:i]) for i in range(len(CUTS))]
    spans = [SpanView(o, start, n, table, images_in(start, n)) for o, (start, n) in zip(offsets, CUTS)]
    rows = torch.cat([q[start : start + n] for start, n in CUTS])
    together = attend(kernel, rows, pool_k, pool_v, spans, window, sinks)
    assert torch.equal(together, torch.cat([whole[start : start + n] for start, n in CUTS]))


def test_a_span_that_cuts_an_image_is_refused():
    with pytest.raises(ValueError, match="may not cut an image"):
        SpanView(0, 0, 30, (0,) * 10, ((20, 40),))


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_the_c_kernels_vector_paths_give_its_plain_paths_bits_with_images(path, half):
    if why := native_unavailable(HEAD_DIM, 3, torch.float32, "cpu"):
        pytest.skip(why)
    if path not in attention_paths():
        pytest.skip(f"this CPU runs the C kernel's {attention_paths()} paths, not {path}")
    q, _, _, pool_k, pool_v, table = pool_and_queries(seed=6, group=3)
    if half:
        pool_k, pool_v = pool_k.half(), pool_v.half()
    spans = [SpanView(0, 0, 60, table, ((5, 6), (20, 52))), SpanView(60, 260, 1, table)]
    spans.append(SpanView(61, 100, 140, table, ((100, 240),)))
    rows = torch.cat([q[:60], q[260:261], q[100:240]])
    for window in (0, 1, 16):
        try:
            use_attention_path(path)
            vectors = attend(NATIVE, rows, pool_k, pool_v, spans, window, None, 3)
            use_attention_path("plain")
            plain = attend(NATIVE, rows, pool_k, pool_v, spans, window, None, 3)
        finally:
            use_attention_path(None)
        assert torch.isfinite(plain).all()
        assert torch.equal(vectors, plain), window

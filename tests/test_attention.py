"""Batch-invariant attention: a row's output depends on its own query and keys only.

Run against both batch-invariant kernels (the C one, tpserve/kernels/native_attention.py, and the tiled
products, tpserve/kernels/tiled_attention.py) through the same plans the model builds: rows near the
start, chunks at several offsets, key counts across block edges, decode rounds and Verifies beside
other lanes; float32 and (tiled) bfloat16; one and two torch threads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.kernels.attention import SpanView
from tpserve.kernels.attention_kernels import NATIVE, SPANS, TILED
from tpserve.kernels.native_attention import attention_paths, native_unavailable, use_attention_path
from tpserve.kernels.tiled_attention import KEY_BLOCK

NUM_KEYS = 700
GROUP = 3  # SmolLM2: 9 query heads over 3 KV heads; a piece holds 2 of them
SCALE = 0.125


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"], autouse=True)
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=[TILED, NATIVE], ids=lambda kernel: kernel.name, autouse=True)
def kernel(request):
    if request.param is NATIVE and (why := native_unavailable(64, GROUP, torch.float32, "cpu")):
        pytest.skip(why)
    _KERNEL[0] = request.param
    yield request.param
    _KERNEL[0] = TILED


_KERNEL = [TILED]  # the kernel `attend` runs (the fixture above sets it)


def make_qkv(num_keys: int, dtype, seed: int = 0, num_kv_heads: int = 2, head_dim: int = 64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_keys, num_kv_heads * GROUP, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(num_kv_heads, num_keys, head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v  # keys head-major, as in the pool


def attend(q, pool_k, pool_v, spans, block_size=1):
    kernel = _KERNEL[0]
    if kernel is NATIVE and q.dtype != torch.float32:
        pytest.skip("the C kernel computes float32 only")
    plan = kernel.plan(spans, GROUP, pool_k.shape[1], block_size, "cpu", q.shape[0])
    return kernel.attend(q, pool_k, pool_v, plan, SCALE).view(q.shape)


def in_range(offset: int, base: int, start: int, length: int) -> SpanView:
    """A span whose positions 0..end-1 lie in slots base.. (a table of one-slot blocks)."""
    return SpanView(offset, start, length, tuple(range(base, base + start + length)))


def whole_prefill(q, k, v):
    return attend(q, k, v, [in_range(0, 0, 0, q.shape[0])])


def rows_of(q, k, v, start, num_rows):
    """The rows start..start+num_rows-1 computed as one span over keys 0..end-1 only."""
    end = start + num_rows
    return attend(
        q[start:end], k[:, :end].contiguous(), v[:, :end].contiguous(), [in_range(0, 0, start, num_rows)]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference_attention(dtype):
    q, k, v = make_qkv(NUM_KEYS, dtype)
    ours = whole_prefill(q, k, v)
    mask = torch.arange(NUM_KEYS) <= torch.arange(NUM_KEYS).unsqueeze(1)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.float(), v.float(), attn_mask=mask, scale=SCALE, enable_gqa=True
    ).transpose(0, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref, rtol=tolerance, atol=tolerance)


CUTS = (
    [(start, n) for start in range(0, 20) for n in (1, 2, 3, 5, 16, 20)]  # near the start
    + [(start, n) for n in (33, 64, 188) for start in (0, 37, 100, 250, 256, 400)]  # chunks
    + [(0, 700), (128, 256), (511, 1), (512, 1), (255, 2), (256, 1), (699, 1), (650, 50)]
    + [(KEY_BLOCK - 1, 1), (KEY_BLOCK, 1), (KEY_BLOCK + 1, 3), (2 * KEY_BLOCK - 1, 2), (3 * KEY_BLOCK, 5)]
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_the_whole_prefill_bit_for_bit(dtype):
    # A chunk, a prompt after a cache restore, a decode step: the same numbers as one whole pass.
    q, k, v = make_qkv(NUM_KEYS, dtype)
    whole = whole_prefill(q, k, v)
    bad = [
        (start, n)
        for start, n in CUTS
        if start + n <= NUM_KEYS and not torch.equal(rows_of(q, k, v, start, n), whole[start : start + n])
    ]
    assert not bad


@pytest.mark.parametrize(
    "num_keys", sorted({255, 256, 257, 400, 511, 512, 700, 1100, KEY_BLOCK - 1, KEY_BLOCK + 1, 2 * KEY_BLOCK})
)
def test_a_decode_step_at_every_block_edge_equals_the_whole_prefill(num_keys):
    q, k, v = make_qkv(num_keys, torch.float32, seed=1)
    whole = whole_prefill(q, k, v)
    for start in {num_keys - 1, num_keys - 2, num_keys // 2}:
        assert torch.equal(rows_of(q, k, v, start, 1), whole[start : start + 1]), start


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (1, 64), (1, 16)])
def test_a_round_of_lanes_and_verifies_equals_each_lane_alone(dtype, num_kv_heads, head_dim):
    # Lanes at different lengths in one pass, decode steps and Verifies (16 tokens) beside a
    # prompt chunk: each row as if computed alone, bit for bit, and as in the whole prefill. One
    # KV head (a piece of SmolLM2's 2+1 split) makes a lane alone a batch of one product.
    q, k, v = make_qkv(NUM_KEYS, dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)
    whole = whole_prefill(q, k, v)
    parts = [(0, 1), (16, 1), (299, 1), (698, 1), (40, 16), (5, 1), (255, 1), (256, 16), (100, 188)]
    pool_k = torch.cat([k] * len(parts), dim=1)
    pool_v = torch.cat([v] * len(parts), dim=1)
    spans, offset = [], 0
    for lane, (start, n) in enumerate(parts):
        spans.append(in_range(offset, lane * NUM_KEYS, start, n))
        offset += n
    queries = torch.cat([q[start : start + n] for start, n in parts])
    together = attend(queries, pool_k, pool_v, spans)
    for span in spans:
        rows = slice(span.offset, span.offset + span.length)
        alone = attend(queries[rows], pool_k, pool_v, [SpanView(0, span.start, span.length, span.blocks)])
        assert torch.equal(together[rows], alone)
        assert torch.equal(together[rows], whole[span.start : span.end])


def test_masked_keys_never_leak_whatever_the_pool_holds():
    # Slots past a lane's keys hold another stream's numbers (or garbage): they must not count.
    q, k, v = make_qkv(300, torch.float32)
    clean = rows_of(q, k, v, 290, 10)
    noisy_k = torch.cat([k, torch.full((2, 100, 64), 1e30)], dim=1)
    noisy_v = torch.cat([v, torch.full((2, 100, 64), float("nan"))], dim=1)
    out = attend(q[290:300], noisy_k, noisy_v, [in_range(0, 0, 290, 10)])
    assert torch.equal(out, clean)


def test_the_fused_kernel_reads_each_span_from_its_own_lane():
    q, k, v = make_qkv(300, torch.float32)
    pool_k = torch.cat([k, torch.randn(2, 100, 64), k], dim=1)
    pool_v = torch.cat([v, torch.randn(2, 100, 64), v], dim=1)
    spans = [in_range(0, 0, 290, 10), in_range(10, 400, 290, 10)]
    queries = torch.cat([q[290:300], q[290:300]])
    out = SPANS.attend(queries, pool_k, pool_v, SPANS.plan(spans, GROUP, 700, 1, "cpu", 20), SCALE)
    torch.testing.assert_close(out[:10], out[10:])
    tiled = attend(queries, pool_k, pool_v, spans).reshape(20, -1)
    torch.testing.assert_close(tiled, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128])
@pytest.mark.parametrize("group", [1, GROUP, 4, 7])
def test_the_c_kernels_vector_paths_give_its_plain_paths_bits(kernel, path, head_dim, group):
    # The vector paths take 16 or 8 keys' scores at once and sum values in registers; each key's tree
    # and each row's key order are the plain path's, so every case here is equal bit for bit:
    # prefills across key-block edges, decode rows beside them, a Verify, scores far from zero.
    if kernel is not NATIVE:
        pytest.skip("the C kernel's own paths")
    if path not in attention_paths():
        pytest.skip(f"this CPU runs the C kernel's {attention_paths()} paths, not {path}")
    gen = torch.Generator().manual_seed(head_dim * group)
    num_kv_heads, slots = 2, 400
    pool_k = 3 * torch.randn(num_kv_heads, slots, head_dim, generator=gen)
    pool_v = torch.randn(num_kv_heads, slots, head_dim, generator=gen)
    spans = [
        in_range(0, 0, 0, 37),
        in_range(37, 100, 260, 1),
        in_range(38, 380, 15, 1),
        in_range(39, 200, 16, 5),
    ]
    q = torch.randn(44, num_kv_heads * group, head_dim, generator=gen)
    plan = NATIVE.plan(spans, group, slots, 1, "cpu", q.shape[0])
    try:
        use_attention_path(path)
        vectors = NATIVE.attend(q, pool_k, pool_v, plan, SCALE)
        use_attention_path("plain")
        plain = NATIVE.attend(q, pool_k, pool_v, plan, SCALE)
    finally:
        use_attention_path(None)
    assert torch.isfinite(plain).all()
    assert torch.equal(vectors, plain)


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("path", ["plain", "avx2", "avx512"])
def test_a_float16_pool_gives_the_bits_of_a_float32_pool_holding_its_values(kernel, path, head_dim):
    # kv_dtype auto keeps the C kernel's pool in float16; it widens each key and value exactly (the
    # vector paths as they load them, at head_dims of whole value chunks; else each span first), so
    # only the store rounds, and attention over a float16 pool is attention over those values.
    if kernel is not NATIVE:
        pytest.skip("the C kernel reads a float16 pool itself")
    if path not in attention_paths():
        pytest.skip(f"this CPU runs the C kernel's {attention_paths()} paths, not {path}")
    q, k, v = make_qkv(300, torch.float32, seed=5, head_dim=head_dim)
    spans = [in_range(0, 0, 0, 40), in_range(40, 0, 299, 1)]
    rows = torch.cat([q[:40], q[299:300]])
    plan = NATIVE.plan(spans, GROUP, k.shape[1], 1, "cpu", rows.shape[0])
    try:
        use_attention_path(path)
        half = NATIVE.attend(rows, k.half(), v.half(), plan, SCALE)
        widened = NATIVE.attend(rows, k.half().float(), v.half().float(), plan, SCALE)
    finally:
        use_attention_path(None)
    assert torch.equal(half, widened)
    assert not torch.equal(half, NATIVE.attend(rows, k, v, plan, SCALE))  # the store did round


def test_the_fused_call_rounds_its_stores_into_a_float16_pool_as_torch_does():
    # rotate_store_attend writes the rotated keys and the values as float16, round to nearest even,
    # the very bits the torch path's write_kv stores.
    if why := native_unavailable(64, GROUP, torch.float32, "cpu"):
        pytest.skip(why)
    num_tokens, num_kv_heads, head_dim = 5, 2, 64
    num_q = num_kv_heads * GROUP
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(num_tokens, (num_q + 2 * num_kv_heads) * head_dim, generator=gen) * 3
    angles = torch.randn(num_tokens, 1, head_dim // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    pools = [
        torch.zeros(num_kv_heads, 16, head_dim, dtype=dtype)
        for dtype in (torch.float16,) * 2 + (torch.float32,) * 2
    ]
    slots = torch.arange(3, 3 + num_tokens)
    spans = [in_range(0, 3, 0, num_tokens)]  # slots 3.. hold positions 0..4
    plan = NATIVE.plan(spans, GROUP, 16, 1, "cpu", num_tokens)
    NATIVE.rotate_store_attend(qkv, num_q, None, (cos, sin), slots, pools[0], pools[1], plan, SCALE)
    NATIVE.rotate_store_attend(qkv, num_q, None, (cos, sin), slots, pools[2], pools[3], plan, SCALE)
    assert all(bool((pool[:, 3:8] != 0).all()) for pool in pools)  # every stored row written
    assert torch.equal(pools[0], pools[2].half()) and torch.equal(pools[1], pools[3].half())

"""Attention through block tables: keys spread over shuffled KV blocks give the bits of the same keys
laid out contiguously, on every kernel (the C kernel's three paths, the tiled products, SDPA), for
block sizes 1, 16, 24 and 32, float32 and float16 pools: whole prefills, chunks, Verifies and
decode rounds of streams at different lengths sharing one pool; and through the model's own pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import write_tiny_model

from tpserve.kernels.attention import SpanView, causal, kv_slots
from tpserve.kernels.attention_kernels import NATIVE, SPANS, TILED
from tpserve.kernels.linear import ROW_TILE
from tpserve.kernels.native_attention import attention_paths, native_unavailable, use_attention_path
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

GROUP, HEAD_DIM, NUM_KV_HEADS, SCALE = 3, 64, 2, 0.125
BLOCK_SIZES = (1, 16, 24, 32)
# (start, length) of each stream's span in a pass, its keys 0..start+length-1: decode steps at and
# around block edges, a Verify, chunks, a first chunk, a long prefill.
PARTS = ((0, 1), (15, 1), (31, 1), (32, 1), (299, 1), (47, 1), (40, 16), (100, 50), (0, 20), (0, 300))
KERNELS = [("native", path) for path in ("plain", "avx2", "avx512")] + [("tiled", None), ("spans", None)]


@pytest.fixture(params=KERNELS, ids=lambda k: k[1] or k[0])
def kernel(request):
    name, path = request.param
    if name != "native":
        yield {"tiled": TILED, "spans": SPANS}[name]
        return
    if why := native_unavailable(HEAD_DIM, GROUP, torch.float32, "cpu"):
        pytest.skip(why)
    if path not in attention_paths():
        pytest.skip(f"this CPU runs the C kernel's {attention_paths()} paths, not {path}")
    torch.set_num_threads(1)
    use_attention_path(path)
    yield NATIVE
    use_attention_path(None)


def paged(keys, values, block_size: int, gen, spare: int = 3):
    """keys, values: per stream [Hkv, n, D] (its positions 0..n-1). Returns pools [Hkv, slots, D]
    holding them in blocks of block_size at shuffled places among `spare` unused blocks, and each
    stream's table. Every slot no stream fills holds NaN: a read of one would show."""
    counts = [-(-k.shape[1] // block_size) for k in keys]
    ids = torch.randperm(sum(counts) + spare, generator=gen).tolist()
    shape = (NUM_KV_HEADS, len(ids) * block_size, HEAD_DIM)
    pools = [torch.full(shape, float("nan"), dtype=keys[0].dtype) for _ in range(2)]
    tables = []
    for k, v, count in zip(keys, values, counts):
        table, ids = tuple(ids[:count]), ids[count:]
        for i, block in enumerate(table):
            for pool, x in zip(pools, (k, v)):
                part = x[:, i * block_size : (i + 1) * block_size]
                pool[:, block * block_size : block * block_size + part.shape[1]] = part
        tables.append(table)
    return *pools, tables


def contiguous(keys, values):
    """The same keys one stream after another: pools [Hkv, sum n, D] and each stream's table of
    one-slot blocks (the layout before block tables)."""
    bases = [sum(k.shape[1] for k in keys[:i]) for i in range(len(keys))]
    tables = [tuple(range(b, b + k.shape[1])) for b, k in zip(bases, keys)]
    return torch.cat(keys, dim=1), torch.cat(values, dim=1), tables


def attend(kernel, q, pool_k, pool_v, spans, block_size):
    plan = kernel.plan(spans, GROUP, pool_k.shape[1], block_size, "cpu", q.shape[0])
    return kernel.attend(q, pool_k, pool_v, plan, SCALE)


def streams(parts, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qs, ks, vs = [], [], []
    for start, length in parts:
        qs.append(torch.randn(length, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen))
        for into in (ks, vs):
            into.append(torch.randn(NUM_KV_HEADS, start + length, HEAD_DIM, generator=gen).to(dtype))
    return qs, ks, vs, gen


def packed(parts, tables):
    offsets = [sum(length for _, length in parts[:i]) for i in range(len(parts))]
    return [SpanView(o, s, n, t) for o, (s, n), t in zip(offsets, parts, tables)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_shuffled_blocks_give_the_bits_of_contiguous_keys(kernel, block_size, dtype):
    # A pass of ten streams sharing one pool, and each stream alone: decode steps, a Verify, chunks,
    # a first chunk, a long prefill (the tiled kernel's long-span path).
    qs, ks, vs, gen = streams(PARTS, dtype, seed=block_size)
    pool_k, pool_v, tables = paged(ks, vs, block_size, gen)
    flat_k, flat_v, ranges = contiguous(ks, vs)
    q = torch.cat(qs)
    together = attend(kernel, q, pool_k, pool_v, packed(PARTS, tables), block_size)
    assert torch.isfinite(together).all()
    assert torch.equal(together, attend(kernel, q, flat_k, flat_v, packed(PARTS, ranges), 1))
    offset = 0
    for part, rows, table, in_range in zip(PARTS, qs, tables, ranges):
        alone = attend(kernel, rows, pool_k, pool_v, packed([part], [table]), block_size)
        assert torch.equal(alone, attend(kernel, rows, flat_k, flat_v, packed([part], [in_range]), 1)), part
        assert torch.equal(alone, together[offset : offset + part[1]]), part
        offset += part[1]


def test_the_c_kernels_paths_agree_through_shuffled_tables():
    if why := native_unavailable(HEAD_DIM, GROUP, torch.float32, "cpu"):
        pytest.skip(why)
    for dtype in (torch.float32, torch.float16):
        qs, ks, vs, gen = streams(PARTS, dtype, seed=7)
        pool_k, pool_v, tables = paged(ks, vs, 24, gen)
        outs = []
        try:
            for path in attention_paths():
                use_attention_path(path)
                outs.append(attend(NATIVE, torch.cat(qs), pool_k, pool_v, packed(PARTS, tables), 24))
        finally:
            use_attention_path(None)
        assert all(torch.equal(out, outs[0]) for out in outs[1:]), attention_paths()


def test_kv_slots_follow_each_spans_table():
    spans = [SpanView(0, 14, 3, (5, 2, 9)), SpanView(3, 0, 2, (7,)), SpanView(5, 23, 1, (1, 0, 4, 3))]
    # positions 14, 15: the table's 2nd block (2), slots 6, 7 in it; 16: the 3rd (9), slot 0; 0, 1: block
    # 7; 23: the 3rd block (4), slot 7
    assert kv_slots(spans, 8, "cpu").tolist() == [2 * 8 + 6, 2 * 8 + 7, 9 * 8, 7 * 8, 7 * 8 + 1, 4 * 8 + 7]


@pytest.mark.parametrize("kernel", [NATIVE, TILED, SPANS], ids=lambda k: k.name)
def test_a_table_too_short_or_outside_the_pool_is_refused(kernel):
    if kernel is NATIVE and native_unavailable(HEAD_DIM, GROUP, torch.float32, "cpu"):
        pytest.skip("no C kernel")
    with pytest.raises(ValueError, match="needs 3 blocks of 16 tokens; its table has 2"):
        kernel.plan([SpanView(0, 30, 3, (0, 1))], GROUP, 64, 16, "cpu", 3)
    with pytest.raises(ValueError, match="outside the pool's 4"):
        kernel.plan([SpanView(0, 30, 3, (0, 1, 4))], GROUP, 64, 16, "cpu", 3)
    kernel.plan([SpanView(0, 30, 3, (0, 1, 3, 99))], GROUP, 64, 16, "cpu", 3)  # entries past end: ignored
    with pytest.raises(ValueError, match="whole blocks of 16"):
        KVPool(1, 40, [2], HEAD_DIM, torch.float32, block_size=16)


def test_sdpa_gets_no_boolean_mask_and_the_boolean_masks_bits_on_the_cpu():
    # On CUDA a boolean mask beside enable_gqa forces PyTorch's math kernel: a fresh prompt is
    # is_causal, a later chunk the lower-right causal bias (flash), a decode row unmasked.
    assert causal(SpanView(0, 0, 20, ())) == {"is_causal": True}
    assert causal(SpanView(0, 7, 1, ())) == {}
    chunk = causal(SpanView(0, 100, 50, ()))["attn_mask"]
    assert (chunk.seq_len_q, chunk.seq_len_kv) == (50, 150)
    gen = torch.Generator().manual_seed(3)
    for start, length in ((0, 20), (100, 50), (7, 1)):
        end = start + length
        q = torch.randn(1, NUM_KV_HEADS * GROUP, length, HEAD_DIM, generator=gen)
        k, v = (torch.randn(1, NUM_KV_HEADS, end, HEAD_DIM, generator=gen) for _ in range(2))
        mask = torch.arange(end) <= torch.arange(start, end).unsqueeze(1)
        ours = F.scaled_dot_product_attention(
            q, k, v, scale=SCALE, enable_gqa=True, **causal(SpanView(0, start, length, ()))
        )
        boolean = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
        assert torch.equal(ours, boolean), (start, length)


@pytest.mark.parametrize("attention", ["native", "tiled", "spans"])
@pytest.mark.parametrize("block_size", [16, 24])
def test_the_models_passes_through_shuffled_tables_give_the_contiguous_logits(
    tmp_path, attention, block_size
):
    # Two prompts, a chunk and decode steps through the model's own pass (PassPlan: kv_slots, the
    # stores, the kernel's plan), once in a pool of shuffled blocks and once in ranges of one-slot
    # blocks: the same logits bit for bit.
    model = load_rank_model(
        write_tiny_model(tmp_path / "llama", "llama"),
        tp_rank=0,
        tp_size=1,
        dtype=torch.float32,
        max_positions=256,
        row_tile=0 if attention == "spans" else ROW_TILE,
    )
    if attention == "tiled":
        model.serve_attention_tiled()
    if model.attention.name != attention:
        pytest.skip(f"this machine serves {model.attention.name} attention here")
    cfg = model.config
    num_blocks = 12
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(block_size)).tolist()
    tables = [tuple(order[:6]), tuple(order[6:])]  # two streams' blocks, interleaved at random
    pools = [
        KVPool(
            cfg.num_layers,
            num_blocks * block_size,
            model.kv_heads_per_piece(),
            cfg.head_dim,
            torch.float32,
            block_size=block_size,
        ),
        KVPool(cfg.num_layers, 256, model.kv_heads_per_piece(), cfg.head_dim, torch.float32),
    ]
    layouts = [tables, [tuple(range(0, 128)), tuple(range(128, 256))]]
    gen = torch.Generator().manual_seed(1)
    passes = [[(0, 0, 40), (1, 0, 25)], [(0, 40, 10)], [(0, 50, 1), (1, 25, 1)], [(1, 26, 1), (0, 51, 1)]]
    tokens = [[torch.randint(3, cfg.vocab_size, (n,), generator=gen) for _, _, n in p] for p in passes]
    logits = []
    for pool, layout in zip(pools, layouts):
        logits.append([])
        for spans, ids in zip(passes, tokens):
            views, offset = [], 0
            for stream, start, n in spans:
                views.append(SpanView(offset, start, n, layout[stream]))
                offset += n
            positions = torch.cat([torch.arange(start, start + n) for _, start, n in spans])
            rows = [v.offset + v.length - 1 for v in views]
            logits[-1].append(model.forward(torch.cat(ids), positions, views, pool, rows))
    assert all(torch.equal(a, b) for a, b in zip(*logits))

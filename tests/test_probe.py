"""The start-up probe: passes on the product's own kernels, refuses a shape-dependent one by name;
its mixed pass (a prompt chunk beside decode rows) equals separate passes at tp=1 and tp=2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiproc import RankPool
from tiny_models import VARIANTS, write_tiny_model

from tpserve.kernels.collectives import GroupCollectives
from tpserve.kernels.linear import ROW_TILE, linear
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.probe import ProbeFailure, probe_model, shape_dependent_linear
from tpserve.ranks.probe_mixed import probe_mixed_pass


def tiny_rank(tmp_path, variant: str, tp_rank: int, tp_size: int, dtype=torch.float32, quantize="none"):
    return load_rank_model(
        write_tiny_model(tmp_path / variant, variant),
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=dtype,
        max_positions=1024,
        row_tile=ROW_TILE,
        quantize=quantize,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(("tp_rank", "tp_size"), [(0, 1), (0, 2), (1, 2)])
def test_the_probe_passes_on_the_products_own_kernels(tmp_path, variant, tp_rank, tp_size):
    torch.set_num_threads(1)
    probe_model(tiny_rank(tmp_path, variant, tp_rank, tp_size))


def test_the_probe_passes_over_the_float16_pool_the_daemon_serves_from(tmp_path):
    torch.set_num_threads(1)
    model = tiny_rank(tmp_path, "llama", 0, 2)
    probe_model(model, kv_type=torch.float16)


def test_the_probe_passes_in_bfloat16_with_two_threads(tmp_path):
    torch.set_num_threads(2)
    try:
        probe_model(tiny_rank(tmp_path, "llama", 0, 1, torch.bfloat16))
    finally:
        torch.set_num_threads(1)


def test_a_shape_dependent_product_is_refused_naming_its_shape(tmp_path):
    model = tiny_rank(tmp_path, "llama", 0, 2)
    with pytest.raises(ProbeFailure) as failure:
        probe_model(model, product=shape_dependent_linear)
    text = str(failure.value)
    assert "linear qkv (128, 96)" in text  # 2 KV heads: (4 + 2 + 2) x 16 rows of a 96-wide input
    assert "batch_invariant: false" in text and "--batch-invariant false" in text
    assert "torch" in text and "BLAS" in text  # the machine it failed on


def test_an_untiled_product_is_caught_where_the_blas_rounds_by_shape(tmp_path):
    # The plain BLAS call, without tiles: on every CPU seen so far one row and sixteen round
    # differently. Where it does not, the probe rightly passes.
    model = tiny_rank(tmp_path, "llama", 0, 1)
    x = torch.randn(17, 96)
    weight = model.layers[0].self_attn.pieces[0].w_qkv
    rounds_by_shape = not torch.equal(
        torch.nn.functional.linear(x[:1], weight), torch.nn.functional.linear(x, weight)[:1]
    )
    if not rounds_by_shape:
        pytest.skip("this BLAS rounds one row as it does seventeen")
    with pytest.raises(ProbeFailure, match="linear"):
        probe_model(model, product=lambda rows, w, b, tile: torch.nn.functional.linear(rows, w, b))


def test_a_shape_dependent_attention_is_refused(tmp_path):
    model = tiny_rank(tmp_path, "llama", 0, 2)

    def shifted(q, pool_k, pool_v, plan, scale):
        out = model.attention.attend(q, pool_k, pool_v, plan, scale)
        return out * (1 + 1e-3 * (len(plan.spans) > 1))

    with pytest.raises(ProbeFailure, match=r"attention \(2 KV heads x 2 queries, head_dim 16"):
        probe_model(model, product=linear, attention=shifted)


# ---- the mixed pass (tpserve/ranks/probe_mixed.py) ------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_mixed_pass_probe_passes_on_the_served_kernels(tmp_path, variant):
    torch.set_num_threads(1)
    model = tiny_rank(tmp_path, variant, 0, 1)
    probe_mixed_pass(model, torch.float32, 16)
    probe_mixed_pass(model, torch.float16, 32)  # the pool the daemon serves from on the C kernel
    model.serve_attention_tiled()  # the fallback where a rank has no C kernel
    probe_mixed_pass(model, torch.float32, 32)


def _mixed_pair(ctx, model_dir):
    torch.set_num_threads(1)
    model = load_rank_model(
        model_dir,
        tp_rank=ctx.rank,
        tp_size=2,
        dtype=torch.float32,
        max_positions=1024,
        row_tile=ROW_TILE,
        collectives=GroupCollectives(dist.group.WORLD, ctx.rank, 2),
    )
    probe_mixed_pass(model, torch.float32, 16)
    return ctx.rank


def test_the_mixed_pass_probe_passes_on_two_ranks(tmp_path):
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    with RankPool(2) as pool:
        assert pool.run(_mixed_pair, str(model_dir), timeout_s=120) == [0, 1]


def test_a_mixed_pass_over_untiled_products_is_refused_where_the_blas_rounds_by_shape(tmp_path):
    # Untiled products (row_tile 0, batch_invariant off): a row's bits follow the pass's row count
    # on every CPU seen so far, so a chunk beside decode rows differs from the chunk alone.
    torch.set_num_threads(1)
    model = load_rank_model(
        write_tiny_model(tmp_path / "llama", "llama"),
        tp_rank=0,
        tp_size=1,
        dtype=torch.float32,
        max_positions=1024,
        row_tile=0,
    )
    weight = model.layers[0].self_attn.pieces[0].w_qkv
    x = torch.randn(33, weight.shape[1])
    if torch.equal(torch.nn.functional.linear(x[:3], weight), torch.nn.functional.linear(x, weight)[:3]):
        pytest.skip("this BLAS rounds three rows as it does thirty-three")
    with pytest.raises(
        ProbeFailure, match="a pass with a prompt chunk beside decode rows differs"
    ) as failure:
        probe_mixed_pass(model, torch.float32, 16)
    assert "batch_invariant: false" in str(failure.value)

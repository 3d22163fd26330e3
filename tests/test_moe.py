"""Mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE, GLM-4.5): against transformers' own models, which write the
tiny checkpoints themselves; tp=2 against tp=1 bit for bit, every stream of a batch against its solo
run, chunks against the whole prompt. (GLM-4.5's own config and routing: tests/test_glm4_moe.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import check_against_transformers, check_chunks_equal_whole
from multiproc import RankPool
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo
from tiny_hf_models import write_hf_model

from bench.moe_models import main as moe_models_main
from bench.moe_split import run_moe_split
from tpserve.kernels.linear import ROW_TILE
from tpserve.kernels.moe import expert_sum, route
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import load_model_config, parse_model_config

VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3-moe", {}),
    "qwen3-moe-unnormalised": ("qwen3-moe", {"norm_topk_prob": False, "mlp_only_layers": []}),
    # Qwen2-MoE (tests/tiny_hf_models.py: a gated shared expert, layer 1 dense), and normalised with
    # only every second layer sparse (decoder_sparse_step)
    "qwen2-moe": ("qwen2-moe", {}),
    "qwen2-moe-step": (
        "qwen2-moe",
        {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    # GLM-4.5 (tests/tiny_hf_models.py: grouped routing, shared experts, q/k norms and biases, half
    # rotary), and without q/k norms nor biases, unnormalised, rotary on 12 of 16 dims, one group
    "glm4-moe": ("glm4-moe", {}),
    "glm4-moe-plain": (
        "glm4-moe",
        {
            "use_qk_norm": False,
            "attention_bias": False,
            "norm_topk_prob": False,
            "partial_rotary_factor": 0.75,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
        },
    ),
}
# int4: blocks of 32 inputs in every piece of every expert (GLM's shared and dense MLPs too)
INT4_VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen2-moe": ("qwen2-moe", {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}),
    "glm4-moe": ("glm4-moe", {"moe_intermediate_size": 64, "intermediate_size": 128}),
}


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("row_tile", [0, ROW_TILE], ids=["plain", "batch-invariant"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_matches_transformers(tmp_path, variant, row_tile):
    family, overrides = VARIANTS[variant]
    check_against_transformers(write_hf_model(tmp_path / variant, family, **overrides), row_tile)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_tp2_equals_tp1_and_batched_equals_solo(pool, tmp_path, variant):
    family, overrides = VARIANTS[variant]
    model_dir = str(write_hf_model(tmp_path / variant, family, **overrides))
    check_tp2_equals_tp1_and_batched_equals_solo(pool, model_dir, "none")


@pytest.mark.parametrize("variant", sorted(INT4_VARIANTS))
def test_int4_experts_tp2_equal_tp1_and_batched_equals_solo(pool, tmp_path, variant):
    # every expert's slices packed as the dense MLP's would be (tpserve/kernels/weight_formats.py). (int8
    # is left out: its float16 down product, FBGEMM's, gives a row other bits alone than batched
    # on this AVX2 CPU for the dense tiny models too, which the start-up probe refuses.)
    family, overrides = INT4_VARIANTS[variant]
    model_dir = str(write_hf_model(tmp_path / variant, family, **overrides))
    check_tp2_equals_tp1_and_batched_equals_solo(pool, model_dir, "int4")


@pytest.mark.parametrize("first_cut", [13, 33])
@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe", "qwen2-moe", "glm4-moe"])
def test_a_prompt_in_chunks_and_decode_steps_has_the_logits_of_the_whole_prompt(tmp_path, variant, first_cut):
    # (a cut at 13 caught GLM's router sigmoid rounding its vector tail on other rows per batch)
    check_chunks_equal_whole(write_hf_model(tmp_path / variant, variant), first_cut)


def test_qwen3_moe_reads_its_dense_and_sparse_layers(tmp_path):
    moe = load_model_config(write_hf_model(tmp_path / "m", "qwen3-moe", decoder_sparse_step=1)).moe
    assert moe.sparse_layers == (0, 2) and moe.num_experts == 8 and moe.num_experts_per_tok == 3
    assert moe.normalize_top_k and moe.expert_size == 18


def test_qwen2_moe_reads_its_gated_shared_expert_and_dense_layers(tmp_path):
    config = load_model_config(write_hf_model(tmp_path / "m", "qwen2-moe"))
    moe = config.moe
    assert config.family == "qwen2_moe" and config.qkv_bias and moe.sparse_layers == (0, 2)
    assert moe.shared_size == 20 and moe.shared_gate and not moe.normalize_top_k
    assert moe.shared_names(0)[2] == "model.layers.0.mlp.shared_expert.down_proj.weight"


def test_qwen2_moe_sliding_layers_it_cannot_place_are_refused_by_name(tmp_path):
    # transformers 4 slid the layers from max_window_layers on, 5 the even ones below it
    raw = json.loads((write_hf_model(tmp_path / "m", "qwen2-moe") / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k != "layer_types"} | {"use_sliding_window": True}
    with pytest.raises(ModelFileError, match="use_sliding_window without layer_types is not implemented"):
        parse_model_config(raw)


def test_the_split_benchmark_times_both_splits_of_the_same_experts():
    report = run_moe_split(num_experts=4, top_k=2, hidden=32, expert_size=16, rows=(1, 3), num_samples=2)
    assert [r["rows"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["tp_ms"] > 0 and r["ep_ms"] > 0 and 0.5 <= r["busier_share"] <= 1.0
    # expert parallelism's two shares add up to the whole layer's sum
    gen = torch.Generator().manual_seed(0)
    x, logits = torch.randn(5, 32, generator=gen), torch.randn(5, 4, generator=gen)
    gate_ups = [torch.randn(32, 32, generator=gen) for _ in range(4)]
    downs = [torch.randn(32, 16, generator=gen) for _ in range(4)]
    weights, experts = route(logits, 2, True)
    whole = expert_sum(x, weights, experts, gate_ups, downs, ROW_TILE)
    halves = [
        expert_sum(x, weights, experts, gate_ups, downs, ROW_TILE, held=range(a, a + 2)) for a in (0, 2)
    ]
    torch.testing.assert_close(halves[0] + halves[1], whole)


def test_the_speed_figures_models_load_with_half_their_weights_on_a_rank(tmp_path):
    args = ["--out", str(tmp_path), "--hidden", "128", "--layers", "1", "--experts", "4", "--top-k", "2"]
    assert (
        moe_models_main(
            [*args, "--expert-size", "32", "--quantize", "none", "--json", str(tmp_path / "m.json")]
        )
        == 0
    )
    rows = json.loads((tmp_path / "m.json").read_text())["models"]
    assert load_model_config(rows["moe"]["dir"]).moe.num_experts == 4
    assert load_model_config(rows["dense"]["dir"]).intermediate_size == 64  # top-k experts wide
    for row in rows.values():  # float32 served as stored: half, and the norms and router whole
        assert row["checkpoint_bytes"] / 2 <= row["rank0_bytes"] < row["checkpoint_bytes"]

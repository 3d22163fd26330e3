"""Mixtures of experts (Mixtral, Qwen3-MoE): against transformers' own models, which write the tiny
checkpoints themselves; tp=2 against tp=1 bit for bit, every stream of a batch against its solo run."""

from __future__ import annotations

import pytest
from hf_reference import check_against_transformers
from multiproc import RankPool
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo
from tiny_hf_models import write_hf_model

from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.model_config import load_model_config

VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3-moe", {}),
    "qwen3-moe-unnormalised": ("qwen3-moe", {"norm_topk_prob": False, "mlp_only_layers": []}),
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


def test_qwen3_moe_reads_its_dense_and_sparse_layers(tmp_path):
    moe = load_model_config(write_hf_model(tmp_path / "m", "qwen3-moe", decoder_sparse_step=1)).moe
    assert moe.sparse_layers == (0, 2) and moe.num_experts == 8 and moe.num_experts_per_tok == 3
    assert moe.normalize_top_k and moe.expert_size == 18

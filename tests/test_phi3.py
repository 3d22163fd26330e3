"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj split on load, longrope within
its original context, Phi-4-mini's partial rotary; checked against transformers' own Phi3ForCausalLM,
tp=2 against tp=1, batched against solo, chunks against the whole prompt."""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import check_against_transformers, check_chunks_equal_whole
from multiproc import RankPool
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo
from tiny_hf_models import write_hf_model

from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import load_model_config, parse_model_config


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("row_tile", [0, ROW_TILE], ids=["plain", "batch-invariant"])
@pytest.mark.parametrize("family", ["phi3", "phi3-longrope", "phi4-mini"])
def test_phi3_matches_transformers(tmp_path, family, row_tile):
    check_against_transformers(write_hf_model(tmp_path / family, family), row_tile)


@pytest.mark.parametrize("family", ["phi3", "phi4-mini"])
def test_phi3_tp2_equals_tp1_and_batched_equals_solo(pool, tmp_path, family):
    model_dir = str(write_hf_model(tmp_path / family, family))
    check_tp2_equals_tp1_and_batched_equals_solo(pool, model_dir, "none")


def test_phi4_mini_prompt_in_chunks_has_the_logits_of_the_whole_prompt(tmp_path):
    check_chunks_equal_whole(write_hf_model(tmp_path / "phi4-mini", "phi4-mini"), 13)


def test_phi4_mini_rotates_three_quarters_of_each_head(tmp_path):
    config = load_model_config(write_hf_model(tmp_path / "phi4-mini", "phi4-mini"))
    assert config.rotary_dim == 12 and config.rope_scaling.short_factor == (1.0, 1.5, 2.0, 2.5, 3.0, 3.5)


def test_longrope_past_its_original_context_is_refused(tmp_path):
    model_dir = write_hf_model(tmp_path / "phi3", "phi3-longrope")
    with pytest.raises(ModelFileError, match="longrope's long factors \\(past 256 positions\\) are not"):
        load_rank_model(model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=512)


def test_phi3_with_a_sliding_window_matches_transformers_past_it(tmp_path):
    # Phi-3-mini-4k's config carries a window (2047 tokens); here one of 20, which a 90-token prompt
    # outgrows: every layer slides.
    model_dir = write_hf_model(tmp_path / "phi3", "phi3", sliding_window=20)
    check_against_transformers(model_dir, ROW_TILE)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lm_head_bias": True}, "lm_head_bias (a bias on the head) is not implemented"),
        ({"partial_rotary_factor": 0.3125}, "partial rotary over 5 of 16 dims: not an even count"),
        (
            {"partial_rotary_factor": 0.5},
            "longrope's short_factor must hold 4 numbers (half the rotary dims)",
        ),
    ],
    ids=["head-bias", "odd-rotary", "factors-for-other-dims"],
)
def test_phi4_mini_shapes_not_computed_are_refused_by_name(tmp_path, fields, message):
    raw = json.loads((write_hf_model(tmp_path / "phi4-mini", "phi4-mini") / "config.json").read_text())
    raw["rope_parameters"].pop("partial_rotary_factor")
    with pytest.raises(ModelFileError) as refused:
        parse_model_config(raw | fields)
    assert message in str(refused.value)

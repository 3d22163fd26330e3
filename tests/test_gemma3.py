"""Gemma 3 text (tpserve/ranks/models/gemma3.py) against transformers' own Gemma3ForCausalLM on a tiny model it
writes itself: local and global layers with their two rotary bases, a window of 8 that a 90-token
prompt outgrows, GeGLU, the four norms a layer, soft-capped logits; tp=2 against tp=1 bit for bit,
batched against solo, chunks against the whole prompt."""

from __future__ import annotations

import pytest
from hf_reference import check_against_transformers, check_chunks_equal_whole
from multiproc import RankPool
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo
from tiny_hf_models import write_hf_model

from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.model_config import parse_model_config


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("row_tile", [0, ROW_TILE], ids=["plain", "batch-invariant"])
def test_gemma3_matches_transformers(tmp_path, row_tile):
    check_against_transformers(write_hf_model(tmp_path / "gemma3", "gemma3"), row_tile)


def test_gemma3_without_soft_capping_matches_transformers(tmp_path):
    model_dir = write_hf_model(tmp_path / "gemma3", "gemma3", final_logit_softcapping=None)
    check_against_transformers(model_dir, ROW_TILE)


def test_a_gemma3_prompt_in_chunks_has_the_whole_prompts_logits(tmp_path):
    check_chunks_equal_whole(write_hf_model(tmp_path / "gemma3", "gemma3"), 13)


def test_gemma3_tp2_equals_tp1_and_batched_equals_solo(pool, tmp_path):
    check_tp2_equals_tp1_and_batched_equals_solo(
        pool, str(write_hf_model(tmp_path / "gemma3", "gemma3")), "none"
    )


def test_an_older_gemma3_config_slides_five_layers_of_six():
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    config = parse_model_config(raw)
    assert config.windows == (512, 512, 512, 512, 512, 0, 512)
    assert config.rope_theta == 1_000_000.0 and config.rope_scaling.factor == 8.0
    assert config.gemma3.local_theta == 10_000.0 and config.gemma3.query_pre_attn_scalar == 256

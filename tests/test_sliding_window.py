"""Sliding-window attention in the model: tiny Mistral, Qwen2 and Qwen3 models with a window of 8
tokens that transformers writes itself, against transformers' own forward on prompts many windows
long (whole, in chunks, decode steps); tp=2 against tp=1 bit for bit, batched against solo; and the
tiled products past whole key blocks behind the window (which they skip) against transformers."""

from __future__ import annotations

import pytest
import torch
from engine_lanes import open_lane
from hf_reference import check_against_transformers, check_chunks_equal_whole, engine_of
from multiproc import RankPool
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo
from tiny_hf_models import write_hf_model

from tpserve.kernels.linear import ROW_TILE

FAMILIES = ["mistral-window", "qwen2-window", "qwen3-window"]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("row_tile", [0, ROW_TILE], ids=["plain", "batch-invariant"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_windowed_model_matches_transformers_past_its_window(tmp_path, family, row_tile):
    # a 90-token prompt (11 windows) in two chunks and two decode steps, and greedy tokens
    check_against_transformers(write_hf_model(tmp_path / family, family), row_tile)


def test_mistral_with_a_window_of_16_matches_transformers_on_a_64_token_prompt(tmp_path):
    # the reproduction: before, every position past 16 attended to the whole prompt
    torch.set_num_threads(1)
    model_dir = write_hf_model(tmp_path / "mistral", "mistral-window", sliding_window=16)
    ids = tuple((11 * i + 5) % 300 for i in range(64))
    engine = engine_of(model_dir, ROW_TILE)
    open_lane(engine, 0, 64)
    ours = engine.forward([(0, 0, ids)])[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
        full = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, sliding_window=None
        )(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert (ours - full).abs().max() > 1e-2  # the window does change the logits here


# Mixtures of experts with a window of 8: Mixtral's on every layer; Qwen2-MoE's where layer_types
# says; Qwen3-MoE's on every layer (use_sliding_window with max_window_layers 0, where transformers 4
# and 5 agree)
MOE_WINDOWS = {
    "mixtral": {"sliding_window": 8},
    "qwen2-moe": {
        "use_sliding_window": True,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "qwen3-moe": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
}


@pytest.mark.parametrize("family", sorted(MOE_WINDOWS))
def test_a_windowed_mixture_of_experts_matches_transformers_past_its_window(tmp_path, family):
    model_dir = write_hf_model(tmp_path / family, family, **MOE_WINDOWS[family])
    check_against_transformers(model_dir, ROW_TILE)
    check_chunks_equal_whole(model_dir, 13)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_in_chunks_has_the_whole_prompts_logits(tmp_path, family):
    check_chunks_equal_whole(write_hf_model(tmp_path / family, family), 13)


@pytest.mark.parametrize("family", ["mistral-window", "qwen2-window"])
def test_a_windowed_model_tp2_equals_tp1_and_batched_equals_solo(pool, tmp_path, family):
    check_tp2_equals_tp1_and_batched_equals_solo(pool, str(write_hf_model(tmp_path / family, family)), "none")


@pytest.mark.parametrize("family", ["qwen2-window", "qwen3-window"])
def test_the_tiled_products_serve_a_windowed_model_as_the_c_kernel_does(tmp_path, family):
    # Where no C kernel builds (or on a device), the tiled products attend within the same windows:
    # chunks equal the whole prompt bit for bit, and the logits are the C kernel's within rounding.
    torch.set_num_threads(1)
    model_dir = write_hf_model(tmp_path / family, family)
    native, tiled = engine_of(model_dir, ROW_TILE), engine_of(model_dir, ROW_TILE)
    tiled.model.serve_attention_tiled()
    ids = tuple((3 * i + 1) % 250 for i in range(60))
    for lane, engine in enumerate((native, tiled)):
        open_lane(engine, lane, 64)
        open_lane(engine, 2 + lane, 64)
    expected = native.forward([(0, 0, ids)])
    whole = tiled.forward([(1, 0, ids)])
    parts = [tiled.forward([(3, 0, ids[:21])]), tiled.forward([(3, 21, ids[21:59])])]
    parts.append(tiled.forward([(3, 59, ids[59:])]))
    assert torch.equal(parts[-1], whole)
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-4)


def test_the_tiled_products_skip_key_blocks_behind_the_window_and_match_transformers(tmp_path):
    # A window of 16 and a 300-token prompt: each row past position 143 has a whole key block of the
    # tiled products (128 keys) behind its window, which it skips (tests/test_attention_windows.py:
    # the same bits as masking it). Whole, in chunks and in decode steps, against transformers.
    torch.set_num_threads(1)
    model_dir = write_hf_model(
        tmp_path / "mistral", "mistral-window", sliding_window=16, max_position_embeddings=512
    )
    ids = tuple((13 * i + 7) % 300 for i in range(300))
    engine = engine_of(model_dir, ROW_TILE, max_positions=512, num_slots=1024)
    engine.model.serve_attention_tiled()
    open_lane(engine, 0, 320)
    open_lane(engine, 1, 320)
    whole = engine.forward([(0, 0, ids)])
    parts = [engine.forward([(1, 0, ids[:140])]), engine.forward([(1, 140, ids[140:298])])]
    parts += [engine.forward([(1, 298, ids[298:299])]), engine.forward([(1, 299, ids[299:])])]
    assert torch.equal(parts[-1], whole)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    for got, row in zip(parts, (139, 297, 298, 299)):
        torch.testing.assert_close(got[0], expected[row], rtol=1e-4, atol=1e-4)

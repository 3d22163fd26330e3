"""Shared KV blocks in every family of tests/tiny_hf_models.py that issue 26 brought (experts, sliding
windows, sinks, Gemma 3's and Phi's shapes): a lane opened on another lane's cached prefix blocks,
whole ones and a partly matching block's copied slots, continues exactly as a cold prefill does, at
tp=1 and, for the families whose attention differs most (gpt-oss's sinks and windows, Gemma 3's two
rotaries), at tp=2 (tests/test_engine_cache.py's turns, there on a dense Llama)."""

from __future__ import annotations

import pytest
import torch
from multiproc import RankPool
from test_engine_cache import _pair, shared_and_cold
from tiny_hf_models import write_hf_model

FAMILIES = ["qwen3-moe", "mixtral", "qwen2-moe", "glm4-moe", "gpt-oss", "gemma3", "phi3", "phi4-mini"]
FAMILIES += ["mistral-window", "qwen2-window"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return lambda family: str(write_hf_model(root / family, family))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_prefix_equals_a_cold_prefill(written, family):
    torch.set_num_threads(1)
    warm, cold, refused, copied = shared_and_cold(written(family), 0, 1)
    assert torch.equal(warm, cold)
    assert torch.equal(copied, cold)
    assert not refused


@pytest.mark.parametrize("family", ["gpt-oss", "gemma3"])
def test_a_shared_prefix_equals_a_cold_prefill_tp2(written, family):
    with RankPool(2) as pool:
        warm, cold, refused, copied = pool.run(_pair, written(family), timeout_s=120)[0]
    assert torch.equal(warm, cold)
    assert torch.equal(copied, cold)
    assert not refused

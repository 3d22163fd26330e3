"""Exactness in every family of tests/tiny_hf_models.py that issue 26 brought (experts, sliding
windows, sinks, Gemma 3's and Phi's shapes), beside what each family's own tests show:
- shared KV blocks: a lane opened on another lane's cached prefix blocks, whole ones and a partly
  matching block's copied slots, continues exactly as a cold prefill does, at tp=1 and, for the
  families whose attention differs most (gpt-oss's sinks and windows, Gemma 3's two rotaries), at
  tp=2 (tests/test_engine_cache.py's turns, there on a dense Llama);
- drafts: a Verify's rows (a token and its drafts, past the sliding window) have the logits the
  same tokens get decoded one at a time, bit for bit, and a lane cut back after a Verify decodes
  on as if the drafts were never fed."""

from __future__ import annotations

import pytest
import torch
from engine_lanes import open_lane, tiny_engine
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


PROMPT = tuple((7 * i + 3) % 300 for i in range(40))  # 5 windows of 8


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verifys_rows_have_the_logits_of_decoding_them_one_at_a_time(written, family):
    torch.set_num_threads(1)
    engine = tiny_engine(written(family), 256, block_size=16)
    n = len(PROMPT)
    fed = (5, 77, 123, 9, 250)  # the token and four drafts
    for lane in (0, 1):
        open_lane(engine, lane, 64)
        engine.forward([(lane, 0, PROMPT)])
    verified = engine.verify([(0, n, fed)])
    one_at_a_time = torch.cat([engine.decode_round([(1, n + i, (token,))]) for i, token in enumerate(fed)])
    assert torch.equal(verified, one_at_a_time)
    # the host keeps two of the drafts: lane 0 goes on from there, as lane 1 from the same tokens
    kept = engine.decode_round([(0, n + 3, (42,))])
    engine.release(1)
    open_lane(engine, 1, 64)
    engine.forward([(1, 0, PROMPT + fed[:3])])
    assert torch.equal(kept, engine.decode_round([(1, n + 3, (42,))]))

"""Gemma 3, gpt-oss, GLM-4.5, Qwen2-MoE and Phi-4-mini served in bfloat16: as near float32 as
transformers' own bfloat16 forward is (Gemma's and gpt-oss's norms scale in float32 and round once,
GLM's router computes in float32, as theirs do), tp=2 == tp=1 bit for bit, batched == solo."""

from __future__ import annotations

import statistics

import pytest
import torch
from engine_lanes import open_lane
from multiproc import RankPool
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo
from tiny_hf_models import transformers, write_hf_model

from tpserve.kernels.linear import ROW_TILE
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

FAMILIES = ("gemma3", "gpt-oss", "glm4-moe", "qwen2-moe", "phi4-mini")
# Eight prompts, since one prompt's error is chance: a token's route can flip between experts in
# either forward (ours 2.4x transformers' error on one of Qwen2-MoE's prompts, 0.2x on another),
# and the largest element of a bfloat16 error swings as much between prompts for a dense family
PROMPTS = [
    tuple((7 * i + 3) % 300 for i in range(40)),
    tuple((5 * i + 2) % 250 for i in range(70)),
    *(tuple((step * i + 1) % 300 for i in range(length)) for step, length in ((3, 50), (11, 60), (13, 30))),
    *(tuple((step * i + 2) % 300 for i in range(length)) for step, length in ((5, 75), (7, 45), (11, 65))),
]


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


def prompt_logits(model_dir, dtype: torch.dtype, ids) -> torch.Tensor:
    """Our last-position logits of `ids` in one pass at tp=1, the KV pool in `dtype`: [vocab]."""
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=1, dtype=dtype, max_positions=256, row_tile=ROW_TILE
    )
    kv = KVPool(model.config.num_layers, 256, model.kv_heads_per_piece(), model.config.head_dim, dtype)
    engine = Engine(model, kv)
    open_lane(engine, 0, len(ids))
    return engine.forward([(0, 0, ids)])[0].float()


# GLM-4.5 was 1.37x transformers' median error here while the tiled attention's bfloat16 products
# rounded every score and every block's weighted values and weight sums to bfloat16 (its biased,
# normed heads share a large unrotated part: raw scores up to 14, where a bfloat16 step is 1/16);
# with the scores alone in float32 1.24x, with every product in float32 (as SDPA keeps them) 1.07x
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_logits_are_as_near_float32_as_transformers_bfloat16(tmp_path, family):
    torch.set_num_threads(1)
    model_dir = write_hf_model(tmp_path / family, family)
    eager = {"experts_implementation": "eager"} if family != "gemma3" else {}
    references = {
        dtype: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **eager)
        for dtype in (torch.float32, torch.bfloat16)
    }
    our_errors, their_errors = [], []
    for ids in PROMPTS:
        with torch.no_grad():
            truth, theirs = (references[d](torch.tensor([ids])).logits[0, -1].float() for d in references)
        ours = prompt_logits(model_dir, torch.bfloat16, ids)
        our_errors.append(float((ours - truth).abs().max()))
        their_errors.append(float((theirs - truth).abs().max()))
        # the float32 choice, where its lead is more than bfloat16's rounding could undo
        top_two = truth.topk(2).values
        if top_two[0] - top_two[1] > 2 * their_errors[-1]:
            assert ours.argmax() == truth.argmax(), ids
    # the median prompt's: a route flipped on one prompt (GLM-4.5's 1.6 against 0.07 on one) is
    # chance, not the rounding this compares
    assert min(our_errors) > 0
    assert statistics.median(our_errors) <= 1.25 * statistics.median(their_errors), (our_errors, their_errors)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_tp2_equals_tp1_and_batched_equals_solo(pool, tmp_path, family):
    model_dir = str(write_hf_model(tmp_path / family, family))
    check_tp2_equals_tp1_and_batched_equals_solo(pool, model_dir, "none", "bfloat16")

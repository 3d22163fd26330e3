"""A stream resumed by prefilling everything it had gives the logits its decode steps gave.

That is how a background stream continues after yielding its lane, and a short prompt is the hard
case: its first positions were computed with fewer than 16 keys, where the BLAS picks another kernel.
"""

from __future__ import annotations

import pytest
import torch
from engine_lanes import open_lane
from tiny_models import write_tiny_model

from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.lane_tables import EngineError
from tpserve.ranks.loader import load_rank_model

PROMPT = (5, 17, 99, 3, 42)
NUM_STEPS = 14  # positions 5..18: across the 16-key edge


def tiny_engine(tmp_path, num_slots: int) -> Engine:
    """One rank of the tiny model with batch-invariant products and a pool of num_slots tokens."""
    torch.set_num_threads(1)
    model = load_rank_model(
        write_tiny_model(tmp_path / "llama", "llama"),
        tp_rank=0,
        tp_size=1,
        dtype=torch.float32,
        max_positions=64,
        row_tile=16,
    )
    config = model.config
    pool = KVPool(config.num_layers, num_slots, model.kv_heads_per_piece(), config.head_dim, model.dtype)
    return Engine(model, pool)


def test_a_short_prompt_resumed_by_re_prefill_gives_the_logits_of_its_decode_steps(tmp_path):
    engine = tiny_engine(tmp_path, 1024)
    open_lane(engine, 0, 40)
    history, step_logits = list(PROMPT), [engine.forward([(0, 0, PROMPT)])[0]]
    for _ in range(NUM_STEPS):
        history.append(int(step_logits[-1].argmax()))
        step_logits.append(engine.forward([(0, len(history) - 1, (history[-1],))])[0])
    differing = []
    for lane, length in enumerate(range(len(PROMPT) + 1, len(history) + 1), start=1):
        open_lane(engine, lane, 40)
        resumed = engine.forward([(lane, 0, tuple(history[:length]))])[0]
        if not torch.equal(resumed, step_logits[length - len(PROMPT)]):
            differing.append(length)
    assert differing == [], f"re-prefills of these lengths differ from the decode steps: {differing}"


def test_only_the_drafts_a_verify_fed_may_be_cut_back(tmp_path):
    engine = tiny_engine(tmp_path, 256)
    open_lane(engine, 0, 40)
    engine.forward([(0, 0, PROMPT)])
    with pytest.raises(EngineError):  # no Verify yet: a stale position is a host bug, not a cut
        engine.decode_round([(0, len(PROMPT) - 1, (7,))])
    start = len(PROMPT)
    logits = engine.verify([(0, start, (7, 8, 9, 10))])
    assert logits.shape[0] == 4  # every row's logits
    with pytest.raises(EngineError):  # below the Verify's first token: not a draft
        engine.decode_round([(0, start, (7,))])
    engine.decode_round([(0, start + 2, (11,))])  # drafts 9 and 10 dropped, 8 kept
    assert engine.lanes[0].length == start + 3

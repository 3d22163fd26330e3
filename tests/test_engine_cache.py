"""Prompt-cache storage in the engine: a restored prefix continues exactly as a cold prefill."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from engine_lanes import open_lane
from multiproc import RankPool
from tiny_models import write_tiny_model

from tpserve.kernels.collectives import GroupCollectives
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

HISTORY = tuple((11 * i + 5) % 300 for i in range(70))
TURN = (17, 4, 99, 23, 8)


def cached_and_cold(model_dir: str, tp_rank: int, tp_size: int):
    model = load_rank_model(
        model_dir,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=torch.float32,
        max_positions=256,
        collectives=GroupCollectives(dist.group.WORLD, tp_rank, tp_size) if tp_size > 1 else None,
        row_tile=16,
    )
    heads, dim, layers = model.kv_heads_per_piece(), model.config.head_dim, model.config.num_layers
    engine = Engine(
        model, KVPool(layers, 512, heads, dim, torch.float32), KVPool(layers, 128, heads, dim, torch.float32)
    )
    # Turn one: prefill the history, keep its first 64 tokens, drop the lane.
    open_lane(engine, 0, 100)
    engine.forward([(0, 0, HISTORY)])
    assert engine.keep(0, 64, entry_id=7)
    assert not engine.keep(0, 64, entry_id=7), "an entry id is kept once"
    engine.release(0)
    # Turn two, warm: restore 64 tokens, prefill the rest of history + the new turn.
    open_lane(engine, 1, 100)
    assert engine.restore(1, 7, 64)
    warm = engine.forward([(1, 64, HISTORY[64:] + TURN)])
    # Turn two, cold, on another lane.
    open_lane(engine, 2, 100)
    cold = engine.forward([(2, 0, HISTORY + TURN)])
    engine.evict(7)
    assert not engine.restore(3, 7, 64), "an evicted entry cannot be restored"
    assert engine.cache_kv.allocator.used == 0
    return (warm, cold) if tp_rank == 0 else None


def _pair(ctx, model_dir):
    torch.set_num_threads(1)
    return cached_and_cold(model_dir, ctx.rank, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama"))


def test_restored_prefix_equals_cold_prefill_tp1(model_dir):
    torch.set_num_threads(1)
    warm, cold = cached_and_cold(model_dir, 0, 1)
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)


def test_restored_prefix_equals_cold_prefill_tp2(model_dir):
    with RankPool(2) as pool:
        warm, cold = pool.run(_pair, model_dir, timeout_s=120)[0]
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)

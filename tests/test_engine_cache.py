"""Shared KV blocks in the engine: a lane opened on another lane's cached prefix blocks, whole ones
and a partly matching block's copied slots, continues exactly as a cold prefill, and the engine
refuses writes into blocks another lane holds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from engine_lanes import open_lane, tiny_engine
from multiproc import RankPool
from tiny_models import write_tiny_model

from tpserve.kernels.collectives import GroupCollectives
from tpserve.ranks.lane_tables import EngineError

HISTORY = tuple((11 * i + 5) % 300 for i in range(70))
TURN = (17, 4, 99, 23, 8)
BLOCK_SIZE = 16


def shared_and_cold(model_dir: str, tp_rank: int, tp_size: int):
    collectives = GroupCollectives(dist.group.WORLD, tp_rank, tp_size) if tp_size > 1 else None
    engine = tiny_engine(model_dir, 512, tp_rank, tp_size, collectives, block_size=BLOCK_SIZE)
    # Turn one computes the history; its first 4 blocks (64 tokens) stay held by lane 0.
    first = open_lane(engine, 0, 100)
    engine.forward([(0, 0, HISTORY)])
    # Turn two, warm: lane 1 opens on those 4 blocks and one of its own, prefills the rest.
    own = tuple(b for b in range(engine.kv.num_blocks) if b not in engine.refs)[:2]
    engine.admit(1, first[:4] + own, num_cached=64)
    with pytest.raises(EngineError, match="cannot open"):
        engine.admit(2, first[:4], num_cached=70)  # a cached prefix is whole blocks
    with pytest.raises(EngineError, match="to copy from KV block"):
        engine.admit(2, first[:4], num_cached=64, copy_from=first[4])  # a copy is never a whole block
    refused = engine.check([(1, 60, (1,))])  # a write into a shared block
    # Turn two, warm with a partial match: lane 3 shares the 4 whole blocks and copies the 6
    # computed slots of lane 0's fifth block into its own, then computes only the turn.
    copy_target = tuple(b for b in range(engine.kv.num_blocks) if b not in engine.refs)[:1]
    engine.admit(3, first[:4] + copy_target, num_cached=70, copy_from=first[4])
    copied = engine.forward([(3, 70, TURN)])
    engine.release(3)
    warm = engine.forward([(1, 64, HISTORY[64:] + TURN)])
    engine.release(0)
    assert all(engine.refs[b] == 1 for b in first[:4]), "lane 1 still holds the shared blocks"
    # Turn two, cold, on another lane.
    open_lane(engine, 2, 100)
    cold = engine.forward([(2, 0, HISTORY + TURN)])
    engine.release(1)
    engine.release(2)
    assert engine.refs == {}
    return (warm, cold, refused, copied) if tp_rank == 0 else None


def _pair(ctx, model_dir):
    torch.set_num_threads(1)
    return shared_and_cold(model_dir, ctx.rank, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama"))


def test_a_shared_prefix_equals_a_cold_prefill_tp1(model_dir):
    torch.set_num_threads(1)
    warm, cold, refused, copied = shared_and_cold(model_dir, 0, 1)
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)
    torch.testing.assert_close(copied, cold, rtol=0, atol=0)
    assert not refused


def test_a_shared_prefix_equals_a_cold_prefill_tp2(model_dir):
    with RankPool(2) as pool:
        warm, cold, refused, copied = pool.run(_pair, model_dir, timeout_s=120)[0]
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)
    torch.testing.assert_close(copied, cold, rtol=0, atol=0)
    assert not refused

"""An engine and its lanes in tests that drive tpserve/ranks/engine.py directly: one rank of a model in
float32 (tiny_engine) and opening lanes on it (tpserve/ranks/engine.py open_lane)."""

from __future__ import annotations

import torch

from tpserve.ranks.engine import Engine, open_lane
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

__all__ = ["open_lane", "tiny_engine"]


def tiny_engine(
    model_dir, num_slots: int, tp_rank: int = 0, tp_size: int = 1, collectives=None, block_size: int = 1
) -> Engine:
    """One rank of `model_dir` in float32 with batch-invariant products (row tiles of 16), positions
    up to 256, and a float32 pool of num_slots KV slots in blocks of block_size."""
    model = load_rank_model(
        model_dir,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=torch.float32,
        max_positions=256,
        collectives=collectives,
        row_tile=16,
    )
    heads, dim, layers = model.kv_heads_per_piece(), model.config.head_dim, model.config.num_layers
    return Engine(model, KVPool(layers, num_slots, heads, dim, torch.float32, block_size=block_size))

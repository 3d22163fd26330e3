"""Opening an engine's lanes in tests that drive ranks/engine.py directly, as rank 0's lane host
would: blocks for the lane's first tokens, the lowest free ids first (server/kv_blocks.py's order)."""

from __future__ import annotations


def open_lane(engine, lane: int, num_tokens: int) -> tuple[int, ...]:
    """Open `lane` with blocks for positions 0..num_tokens-1; the block ids it got."""
    size, held = engine.kv.block_size, set(engine.refs)
    free = [block for block in range(engine.kv.num_blocks) if block not in held]
    blocks = tuple(free[: -(-num_tokens // size)])
    if len(blocks) * size < num_tokens:
        raise AssertionError(f"the pool has no room for {num_tokens} more tokens")
    engine.admit(lane, blocks)
    return blocks

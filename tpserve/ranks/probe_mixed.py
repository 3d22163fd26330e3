"""The start-up probe's mixed pass: a prompt chunk beside decode rows, bit for bit as separate passes.

tpserve/ranks/probe.py checks each product and the attention kernel alone; this checks the claim the
scheduler leans on when it packs a long prompt's chunk into the decode round's pass (Engine.mixed):
a whole forward pass through the engine, the model's own products, attention, norms and
collectives, gives every row the bits it gets in a pass of its own. Two engines over pools of their
own run the same lanes: one decodes and prefills in separate passes, the other in one mixed pass
(after a plain round, then after a Verify's rows); the logits (rank 0's) and every lane's KV
(each rank's own heads) must be equal. Every rank runs it at once: the passes' collectives pair up.
"""

from __future__ import annotations

import torch

from tpserve.kernels.machine import describe_machine
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.probe import OFF_SWITCH, ProbeFailure

# Per lane: its prompt's length before the mixed passes. Lanes 0 and 1 decode; lane 2's prompt goes
# in chunks, its second and third beside their rounds, across block edges.
PROMPTS = (37, 5, 21)
CHUNKS = (30, 18)  # lane 2's chunks beside the round, then beside the Verify
NUM_DRAFTS = 2  # each Verify row's drafts
NUM_POSITIONS = 80  # room per lane
# The same passes, smaller, for a model whose rotary tables end before NUM_POSITIONS (a short context).
SMALL = ((9, 3, 5), (6, 4), 20)


def probe_mixed_pass(model, kv_type: torch.dtype, block_size: int, device_timeout_s: float = 60.0) -> None:
    """Raises ProbeFailure unless a mixed pass of `model` (a TPModel) gives the rows and KV of
    separate passes, over a pool of kv_type in blocks of block_size."""
    prompts, chunks, num_positions = (
        (PROMPTS, CHUNKS, NUM_POSITIONS) if model.max_positions >= NUM_POSITIONS else SMALL
    )
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    tokens = [torch.randint(vocab, (num_positions,), generator=gen).tolist() for _ in prompts]
    separate, mixed = (
        _engine(model, kv_type, block_size, device_timeout_s, order, num_positions) for order in (1, -1)
    )
    for engine in (separate, mixed):
        for lane, length in enumerate(prompts):
            engine.forward([(lane, 0, tuple(tokens[lane][:length]))])
    start, failure = prompts[2], None
    for verify, size in zip((False, True), chunks):
        steps = _steps(separate, tokens, verify)
        chunk = (2, start, tuple(tokens[2][start : start + size]))
        alone = separate.verify(steps) if verify else separate.decode_round(steps)
        alone_chunk = separate.forward([chunk])
        together = mixed.mixed(_steps(mixed, tokens, verify), verify, [chunk])
        # Every pass runs on every rank before any failure is raised: their collectives pair up.
        if alone is not None and not torch.equal(together, torch.cat([alone, alone_chunk])):
            kind = "Verify" if verify else "decode"
            failure = failure or f"a {size}-token prompt chunk beside {len(steps)} {kind} rows: its logits"
        start += size
    for lane in range(len(PROMPTS)):
        if not all(torch.equal(a, b) for a, b in zip(_kv(separate, lane), _kv(mixed, lane))):
            failure = failure or f"lane {lane}'s KV after the mixed passes"
    if failure is not None:
        raise ProbeFailure(
            f"{model.attention.name} attention, {model.dtype}: a pass with a prompt chunk beside decode "
            f"rows differs from separate passes in {failure} ({describe_machine()}); {OFF_SWITCH}"
        )


def _engine(
    model, kv_type, block_size: int, device_timeout_s: float, order: int, num_positions: int
) -> Engine:
    """An engine over a pool of its own, each lane's table its blocks in `order` (-1: reversed, so
    the mixed engine reads its keys through other block ids than the separate one)."""
    per_lane = -(-num_positions // block_size)
    kv = KVPool(
        model.config.num_layers,
        len(PROMPTS) * per_lane * block_size,
        model.kv_heads_per_piece(),
        model.config.head_dim,
        kv_type,
        model.device,
        block_size=block_size,
    )
    engine = Engine(model, kv, device_timeout_s=device_timeout_s)
    blocks = list(range(kv.num_blocks))[::order]
    for lane in range(len(PROMPTS)):
        engine.admit(lane, tuple(blocks[lane * per_lane : (lane + 1) * per_lane]))
    return engine


def _steps(engine: Engine, tokens, verify: bool) -> list[tuple[int, int, tuple[int, ...]]]:
    """The decoding lanes' next rows at their lengths: one token, or one and its drafts."""
    steps = []
    for lane in (0, 1):
        at = engine.lanes[lane].length
        steps.append((lane, at, tuple(tokens[lane][at : at + 1 + (NUM_DRAFTS if verify else 0)])))
    return steps


def _kv(engine: Engine, lane: int) -> list[torch.Tensor]:
    """The lane's keys and values for its computed positions, every piece and layer, in order."""
    state, size = engine.lanes[lane], engine.kv.block_size
    slots = torch.tensor(
        [state.blocks[p // size] * size + p % size for p in range(state.length)], device=engine.model.device
    )
    return [pool[:, :, slots] for pool in (*engine.kv.k, *engine.kv.v)]

"""Shared-memory collectives between CPU ranks on one host: the same bits as gloo, and no wedge.

Two real processes; each test chooses the collectives the way start-up does (votes on the gloo
group), then compares them with gloo's own all_reduce and gather on the same tensors.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from multiproc import Exited, RankPool, run_ranks, world_collectives

from tpserve.kernels.shared_memory import SLOT_BYTES, PeerLost, SharedMemoryCollectives
from tpserve.ranks.collectives_choice import choose_collectives
from tpserve.ranks.errors import UserError

CPU = torch.device("cpu")
FLOATS_PER_SLOT = SLOT_BYTES // 4
# Sizes (in elements) that fit one slot, end exactly on one, and span several.
SIZES = [1, 576, 16 * 576, FLOATS_PER_SLOT, FLOATS_PER_SLOT + 3, 3 * FLOATS_PER_SLOT + 1000]


def _choose(ctx, choice="shared_memory", directory="/dev/shm", timeout_s=10.0):
    return world_collectives(ctx, choice, timeout_s, directory=directory)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


def _compare_with_gloo(ctx):
    shared = _choose(ctx)
    assert isinstance(shared, SharedMemoryCollectives)
    assert shared._native is not None  # the C exchange builds wherever the C kernels do
    mismatches = _compare_on(shared, 100 + ctx.rank, (torch.float32, torch.bfloat16, torch.int64))
    shared._native = None  # float32 through the Python exchange too
    return mismatches + _compare_on(shared, 200 + ctx.rank, (torch.float32,))


def _compare_on(shared, seed, dtypes):
    rank = shared.rank
    generator = torch.Generator().manual_seed(seed)
    mismatches = []
    for dtype in dtypes:
        for size in SIZES:
            if dtype is torch.int64:
                x = torch.randint(-(10**12), 10**12, (size,), generator=generator)
            else:
                x = (torch.randn(size, generator=generator) * 1000).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            if not torch.equal(shared.all_reduce_sum(x), expected) or not torch.equal(x, expected):
                mismatches.append(("all_reduce", dtype, size))
            logits = torch.randn(3, size, generator=generator).to(dtype)
            expected = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
            dist.gather(logits, gather_list=expected, dst=0)
            got = shared.gather_to_first(logits)
            if rank == 0 and not all(torch.equal(a, b) for a, b in zip(got, expected)):
                mismatches.append(("gather", dtype, size))
            if rank == 1 and got is not None:
                mismatches.append(("gather gave a follower chunks", dtype, size))
    return mismatches


def test_sums_and_gathers_equal_gloo_bit_for_bit(pool):
    """float32, bfloat16 and int64; one element to several slots: the exact bits gloo gives."""
    assert pool.run(_compare_with_gloo, timeout_s=120) == [[], []]


def _many_steps_with_skew(ctx, num_steps):
    """Many small sums with random pauses on either side (some past the C exchange's spin and yield,
    so its wait ends in Python's): a slot is never overwritten while read."""
    shared = _choose(ctx)
    pause = random.Random(ctx.rank)
    wrong = []
    for step in range(num_steps):
        if pause.random() < 0.1:
            time.sleep(pause.random() * 0.004)
        x = torch.full((576,), float(step * 10 + ctx.rank))
        shared.all_reduce_sum(x)
        if not torch.all(x == step * 20 + 1):
            wrong.append(step)
    return wrong


def test_back_to_back_steps_stay_correct_under_skew(pool):
    assert pool.run(_many_steps_with_skew, 3000, timeout_s=120) == [[], []]


def _setup_leaves_no_file(ctx, directory):
    shared = _choose(ctx, directory=directory)
    x = torch.ones(10)
    shared.all_reduce_sum(x)
    dist.barrier()
    return type(shared).__name__, x.tolist(), sorted(os.listdir(directory))


def test_the_segment_file_is_gone_once_every_rank_mapped_it(pool, tmp_path):
    results = pool.run(_setup_leaves_no_file, str(tmp_path), timeout_s=60)
    assert results == [("SharedMemoryCollectives", [2.0] * 10, [])] * 2


def _fallback(ctx, directories, choice):
    try:
        chosen = _choose(ctx, choice=choice, directory=directories[ctx.rank])
    except UserError as error:
        return "refused", str(error)
    x = torch.full((4,), float(ctx.rank + 1))
    chosen.all_reduce_sum(x)  # whichever was chosen, both ranks chose the same
    return type(chosen).__name__, x.tolist()


def test_ranks_that_cannot_share_a_segment_fall_back_to_gloo(pool, tmp_path):
    """No shared directory on one rank, or two different directories (as two hosts would have)."""
    one, other = tmp_path / "one", tmp_path / "other"
    one.mkdir()
    other.mkdir()
    for directories in ([str(one), str(tmp_path / "missing")], [str(one), str(other)]):
        results = pool.run(_fallback, directories, "auto", timeout_s=60)
        assert results == [("GroupCollectives", [3.0] * 4)] * 2
    assert (
        pool.run(_fallback, [str(one), str(one)], "gloo", timeout_s=60)
        == [("GroupCollectives", [3.0] * 4)] * 2
    )


def test_required_shared_memory_that_cannot_be_had_refuses_on_every_rank(pool, tmp_path):
    results = pool.run(_fallback, [str(tmp_path), str(tmp_path / "missing")], "shared_memory", timeout_s=60)
    assert [kind for kind, _ in results] == ["refused", "refused"]
    assert all("cannot share a segment" in message for _, message in results)


DEAD_PEER_TIMEOUT_S = 120.0  # far longer than noticing a death takes, however busy the machine


def _peer_fails(ctx, how):
    """Rank 1 dies, or stays alive without joining; rank 0's time to PeerLost and its message."""
    shared = _choose(ctx, timeout_s=DEAD_PEER_TIMEOUT_S if how == "dies" else 0.5)
    if ctx.rank == 1:
        if how == "dies":
            os._exit(3)
        time.sleep(3.0)  # alive, but never joins the collective in time
        return None
    began = time.monotonic()
    try:
        shared.all_reduce_sum(torch.ones(576))
    except PeerLost as error:
        return time.monotonic() - began, str(error)
    return None


def test_a_dead_peer_is_noticed_in_well_under_the_timeout():
    results = run_ranks(_peer_fails, args=("dies",), may_exit={1}, timeout_s=60)
    assert results[1] == Exited(3)
    waited_s, message = results[0]
    assert waited_s < DEAD_PEER_TIMEOUT_S / 2, f"rank 0 waited {waited_s:.2f}s: it waited for the timeout"
    assert "rank 1" in message and "died" in message


def test_a_live_peer_that_never_joins_fails_at_the_timeout():
    waited_s, message = run_ranks(_peer_fails, args=("late",), timeout_s=60)[0]
    assert waited_s >= 0.5  # the timeout, not a death
    assert "rank 1" in message
    assert "rank 1 did not reach" in message


def test_one_rank_has_no_collectives_to_choose():
    assert (
        choose_collectives(
            "auto", rank=0, world_size=1, device=CPU, model_group=None, control_group=None, timeout_s=1.0
        )
        is None
    )
    with pytest.raises(UserError, match="cpu_collectives must be one of"):
        choose_collectives(
            "shm", rank=0, world_size=1, device=CPU, model_group=None, control_group=None, timeout_s=1.0
        )

"""The channel between two real ranks: order, overflow, votes, idling, and losing a peer; over gloo,
and over a shared-memory segment of its own (as ranks on one host run it)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiproc import RankPool, run_ranks

from tpserve.ranks.channel import Channel, ChannelBroken, LeaderLost
from tpserve.ranks.collectives_choice import choose_wire_exchange
from tpserve.ranks.liveness import LeaderWatch, LivenessHub
from tpserve.ranks.model_group import exercise
from tpserve.ranks.wire_messages import Admit, Idle, Prefill, Release, Round, Stop, Verify
from tpserve.ranks.wire_spans import Span, Step

PG_TIMEOUT_S = 3.0
HEARTBEAT_S = 0.5
LEADER_DEAD_AFTER_S = 2.0


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, pg_timeout_s=PG_TIMEOUT_S) as pool:
        yield pool


WIRES = ["gloo", "shared memory"]


def _exchange(ctx, wire: str, timeout_s: float = PG_TIMEOUT_S):
    """The channel's own segment, as start-up builds it, for the shared-memory wire; None for gloo."""
    if wire == "gloo":
        return None
    exchange = choose_wire_exchange(
        "auto", rank=ctx.rank, world_size=ctx.world_size, device=torch.device("cpu"),
        control_group=dist.group.WORLD, timeout_s=timeout_s,
    )  # fmt: skip
    assert exchange is not None, "two ranks on one host share no segment"
    return exchange


def _channel(ctx, wire: str = "gloo") -> Channel:
    return Channel(
        None,
        ctx.store,
        rank=ctx.rank,
        timeout_s=PG_TIMEOUT_S,
        heartbeat_s=HEARTBEAT_S,
        leader_dead_after_s=LEADER_DEAD_AFTER_S,
        exchange=_exchange(ctx, wire),
    )


def _every_kind() -> list:
    long_prefill = Prefill(tuple(Span(lane, 3 * lane, tuple(range(lane, lane + 500))) for lane in range(16)))
    return [
        Admit(lane=0, blocks=tuple(range(40))),
        Prefill((Span(lane=0, start=0, token_ids=(1, 2, 3)),)),
        Round((Step(lane=0, position=3, token_id=42),)),
        Idle(),
        Admit(lane=1, blocks=(41, 42)),
        long_prefill,
        Round(tuple(Step(lane, 100 + lane, lane * 7) for lane in range(30))),
        Verify((Span(lane=1, start=5, token_ids=(4, 5, 6), blocks=(43,)),)),
        Idle(),
        Idle(),
        Round((Step(lane=1, position=6, token_id=9, blocks=(44,)),)),
        Release(lane=0),
        Idle(),
        Stop(),
    ]


def _send_every_kind(ctx, wire):
    channel = _channel(ctx, wire)
    if ctx.rank == 0:
        for msg in _every_kind():
            channel.send(msg)
        return sorted(thread.name for thread in threading.enumerate())
    received = []
    while not received or received[-1] != Stop():  # a follower's loop: run until Stop
        received.append(channel.receive())
    return received


@pytest.mark.parametrize("wire", WIRES)
def test_every_kind_arrives_intact_and_in_order_through_idles_and_overflow(pool, wire):
    rank0_threads, received = pool.run(_send_every_kind, wire, timeout_s=30)
    assert received == _every_kind()
    assert "wire-heartbeat" not in rank0_threads  # Stop ended rank 0's heartbeat


VOTES = [(True, True), (True, False), (False, True), (False, False)]


def _vote(ctx, wire):
    channel = _channel(ctx, wire)
    results = []
    for lane, oks in enumerate(VOTES):
        if ctx.rank == 0:
            channel.send(Admit(lane, (16,)))
        else:
            assert channel.receive() == Admit(lane, (16,))
        results.append(channel.vote(oks[ctx.rank]))
    return results


@pytest.mark.parametrize("wire", WIRES)
def test_one_rank_saying_no_makes_the_vote_fail_on_both(pool, wire):
    assert pool.run(_vote, wire, timeout_s=30) == [[True, False, False, False]] * 2


IDLE_S = PG_TIMEOUT_S + 1.0  # longer than the group's timeout and than leader_dead_after_s


def _idle_then_work(ctx):
    channel = _channel(ctx)
    if ctx.rank == 0:
        channel.send(Idle())
        time.sleep(IDLE_S)
        channel.send(Release(lane=3))
        channel.close()
        return None
    assert channel.receive() == Idle()
    cpu_before, wall_before = time.process_time(), time.monotonic()
    msg = channel.receive()
    return msg, time.process_time() - cpu_before, time.monotonic() - wall_before


def test_an_idle_follower_outlasts_the_group_timeout_without_spinning(pool):
    _, (msg, cpu_s, wall_s) = pool.run(_idle_then_work, timeout_s=30)
    assert msg == Release(lane=3)
    assert wall_s > IDLE_S - 0.5
    assert cpu_s / wall_s < 0.05, f"the idle follower used {cpu_s:.2f}s of CPU in {wall_s:.1f}s"


def _idle_rank0_holds_its_gil(ctx, trusted: bool):
    """Rank 0 idles, then holds its GIL past leader_dead_after_s (its heartbeat thread starves), as a
    tokenizer call on a huge prompt did; the follower waits on the doorbell beside a liveness link."""
    channel = _channel(ctx)
    if ctx.rank == 0:
        hub = LivenessHub("127.0.0.1", 2, LEADER_DEAD_AFTER_S)
        ctx.store.set(f"test/liveness-{trusted}", f"{hub.port}:{hub.token.hex()}")
        hub.accept_followers(timeout_s=10)
        channel.send(Idle())
        ctypes.PyDLL(None).sleep(3 * int(LEADER_DEAD_AFTER_S))  # ctypes.PyDLL keeps the GIL
        try:
            channel.send(Release(lane=3))
            ok = channel.vote(True)
        except ChannelBroken:  # the follower took rank 0 for lost and left the channel
            ok = False
        channel.close()
        ctx.store.wait([f"test/follower-done-{trusted}"])
        hub.close()
        return ok, hub.lost
    port, token = ctx.store.get(f"test/liveness-{trusted}").decode().split(":")
    lost = []
    watch = LeaderWatch(
        "127.0.0.1", int(port), bytes.fromhex(token), rank=1, dead_after_s=LEADER_DEAD_AFTER_S,
        timeout_s=10, on_lost=lost.append,
    )  # fmt: skip
    if trusted:
        channel.trust_leader_link(watch.alive)
    assert channel.receive() == Idle()
    try:
        msg = channel.receive()
    except LeaderLost as err:
        msg = str(err)
    else:
        channel.vote(True)
    watch.close()
    ctx.store.set(f"test/follower-done-{trusted}", "1")
    return msg, lost


def test_an_idle_follower_outlasts_rank0_holding_its_gil_while_the_liveness_link_beats(pool):
    (ok, rank0_lost), (msg, follower_lost) = pool.run(_idle_rank0_holds_its_gil, True, timeout_s=60)
    assert (msg, follower_lost, ok, rank0_lost) == (Release(lane=3), [], True, None)


def test_without_the_liveness_link_a_starved_heartbeat_loses_rank0():
    """The same without trust_leader_link: what the follower did before the link beat natively."""
    # Fresh ranks: rank 0's send then times out in a collective the follower left, which would
    # leave the pool's group out of step.
    _, (msg, _) = run_ranks(_idle_rank0_holds_its_gil, args=(False,), pg_timeout_s=PG_TIMEOUT_S)
    assert msg.startswith("rank 1: no heartbeat nor doorbell from rank 0 within 2s")


def _leader_dies_while_follower_idles(ctx):
    channel = _channel(ctx)
    if ctx.rank == 0:
        channel.send(Idle())
        time.sleep(0.5)
        os._exit(1)
    assert channel.receive() == Idle()
    started = time.monotonic()
    try:
        channel.receive()
    except LeaderLost as err:
        lost_after, message = time.monotonic() - started, str(err)
    else:
        raise AssertionError("receive returned after rank 0 died")
    with pytest.raises(ChannelBroken, match="broke earlier"):
        channel.receive()
    return lost_after, message


@pytest.mark.parametrize(
    "store_on_rank0", [False, True], ids=["store-in-launcher:heartbeat-stops", "store-on-rank0:store-gone"]
)
def test_an_idle_follower_learns_that_rank0_died(store_on_rank0):
    _, (lost_after, message) = run_ranks(
        _leader_dies_while_follower_idles,
        may_exit=(0,),
        timeout_s=40,
        pg_timeout_s=PG_TIMEOUT_S,
        store_on_rank0=store_on_rank0,
    )
    assert lost_after < LEADER_DEAD_AFTER_S + HEARTBEAT_S + 1.0
    assert message.startswith("rank 1: ") and "idle after #0" in message
    assert (
        "rank 0 or the launcher" if store_on_rank0 else "no heartbeat nor doorbell from rank 0"
    ) in message


def _follower_gives_up_on_a_silent_rank0(ctx, wire="gloo"):
    channel = _channel(ctx, wire)
    if ctx.rank == 1:
        started = time.monotonic()
        try:
            channel.receive()
        except ChannelBroken as err:
            waited_s, message = time.monotonic() - started, str(err)
        else:
            raise AssertionError("receive returned though rank 0 sent nothing")
        ctx.store.set("test/follower-gave-up", f"{waited_s}|{message}")
        os._exit(3)  # as a follower does once its channel broke
    # Rank 0 stays silent (busy, say) until the follower has given up and exited.
    waited_s, message = ctx.store.get("test/follower-gave-up").decode().split("|", 1)
    time.sleep(0.5)
    started = time.monotonic()
    try:
        for position in range(1000):
            channel.send(Round((Step(0, position, 7),)))
            channel.vote(True)
    except ChannelBroken as err:
        noticed_after, rank0_message = time.monotonic() - started, str(err)
    else:
        raise AssertionError("rank 0 went on sending to a dead follower")
    with pytest.raises(ChannelBroken, match="broke earlier"):
        channel.vote(True)
    return float(waited_s), message, noticed_after, rank0_message


def test_a_follower_names_a_silent_rank0_and_rank0_learns_of_its_exit_at_the_next_send(pool):
    # Last in the module: the follower's exit ends the pool.
    (waited_s, message, noticed_after, rank0_message), exited = pool.run(
        _follower_gives_up_on_a_silent_rank0, timeout_s=30, may_exit=(1,)
    )
    assert exited.code == 3
    assert waited_s < PG_TIMEOUT_S + 1.5
    assert message.startswith("rank 1: receive #0: rank 0 did not answer")
    assert noticed_after < PG_TIMEOUT_S + 30  # a hang guard: the message says what it learned
    assert rank0_message.startswith("rank 0: send Round #0: the followers did not answer")


def test_over_shared_memory_a_follower_names_a_silent_rank0_and_rank0_learns_of_its_exit():
    (waited_s, message, noticed_after, rank0_message), exited = run_ranks(
        _follower_gives_up_on_a_silent_rank0,
        args=("shared memory",),
        may_exit=(1,),
        timeout_s=60,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    assert exited.code == 3
    assert PG_TIMEOUT_S - 0.5 < waited_s < PG_TIMEOUT_S + 1.5
    assert message.startswith("rank 1: receive #0: rank 0 did not answer")
    # The follower had published its part of #0 before it gave up, so rank 0 learns at the vote
    # after it: the exchange sees the process gone, no timeout waited out.
    assert noticed_after < 2.0
    assert rank0_message.startswith("rank 0: vote after #0: the other ranks did not answer")
    assert "rank 1 (pid" in rank0_message and "died" in rank0_message


def _wire_beside_a_models_group(ctx):
    """As between GPUs: the wire on a gloo group of its own, the model's collectives on another
    group, each message followed by a vote and a model collective (start-up's NCCL check)."""
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    control = dist.new_group(backend="gloo", timeout=timeout)
    model = dist.new_group(backend="gloo", timeout=timeout)
    channel = Channel(
        control, ctx.store, rank=ctx.rank, timeout_s=PG_TIMEOUT_S, heartbeat_s=HEARTBEAT_S,
        leader_dead_after_s=LEADER_DEAD_AFTER_S,
    )  # fmt: skip
    received, votes = [], []
    for msg in _every_kind():
        if ctx.rank == 0:
            channel.send(msg)
        else:
            received.append(channel.receive())
        if not isinstance(msg, (Idle, Stop)):  # as in the engine: no collective while idle
            votes.append(channel.vote(ctx.rank == 0 or not isinstance(msg, Verify)))
            exercise(model, ctx.rank, ctx.world_size, torch.device("cpu"), PG_TIMEOUT_S)
    return received, votes


def test_the_wire_runs_on_a_gloo_subgroup_beside_the_models_own_group(pool):
    (_, votes0), (received, votes1) = pool.run(_wire_beside_a_models_group, timeout_s=60)
    assert received == _every_kind()
    kinds = [msg for msg in _every_kind() if not isinstance(msg, (Idle, Stop))]
    assert votes0 == votes1 == [not isinstance(msg, Verify) for msg in kinds]


def _skip_a_vote(ctx, skipper: int, wire: str):
    """Both ranks exchange a message and vote; then `skipper` goes on without voting. Each rank's
    error and how long it took to raise (the channel's timeout is 60 s)."""
    channel = Channel(
        None,
        ctx.store,
        rank=ctx.rank,
        timeout_s=60.0,
        heartbeat_s=HEARTBEAT_S,
        leader_dead_after_s=LEADER_DEAD_AFTER_S,
        exchange=_exchange(ctx, wire, timeout_s=60.0),
    )
    if ctx.rank == 0:
        channel.send(Admit(0, (16,)))
    else:
        channel.receive()
    channel.vote(True)
    started = time.monotonic()
    try:
        if ctx.rank == 0:
            channel.send(Admit(1, (16,)))
            if skipper != 0:
                channel.vote(True)
            channel.send(Admit(2, (16,)))
        else:
            channel.receive()
            if skipper != 1:
                channel.vote(True)
            channel.receive()
    except ChannelBroken as err:
        return time.monotonic() - started, str(err)
    raise AssertionError(f"rank {ctx.rank} went on although rank {skipper} skipped a vote")


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("skipper", [0, 1])
def test_a_skipped_vote_fails_both_ranks_at_once_naming_the_vote(skipper, wire):
    # A vote met by a message is no mismatched collective left to time out: both ranks read a sum
    # that is neither, and say so.
    results = run_ranks(_skip_a_vote, args=(skipper, wire), timeout_s=120)
    for rank, (took_s, message) in enumerate(results):
        assert "vote" in message and "skipped" in message, f"rank {rank}: {message}"
        assert took_s < 30, f"rank {rank} waited {took_s:.1f} s: the 60 s timeout, not the mismatch"

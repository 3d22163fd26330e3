"""The liveness link (tpserve/ranks/liveness.py) in one process over loopback: beats keep both ends quiet, a
peer that ends is noticed at once, a silent one after dead_after_s, BYE is not a loss, a call that
holds the GIL past dead_after_s is no loss but an interpreter stuck past stall_after_s is, and rank
0 takes each follower rank once, with the token, and then listens no more. The peers that end or
fall silent are plain sockets speaking the link's greeting, as a killed or cut-off rank would."""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
import time

import pytest
from daemon import wait_until

from tpserve.ranks.beats import ENDED, LIVE, PythonBeats
from tpserve.ranks.liveness import LeaderWatch, LivenessHub

DEAD_AFTER_S = 1.5  # beats every 0.3 s: a busy machine's stalls stay well within it
HELLO = struct.Struct("<q16s")  # the link's greeting as a follower sends it: its rank, the token


def hold_the_gil(seconds: int) -> None:
    """Sleep in C without releasing the GIL (ctypes.PyDLL keeps it), as a long tokenizer call does:
    no Python thread of this process runs meanwhile."""
    ctypes.PyDLL(None).sleep(seconds)


class Lost:
    """A follower's on_lost that records instead of exiting the test process."""

    def __init__(self):
        self.message: str | None = None
        self.at: float | None = None

    def __call__(self, message: str) -> None:
        self.message, self.at = message, time.monotonic()


def linked(world_size: int = 2, hub_stall_after_s=None) -> tuple[LivenessHub, list[LeaderWatch], list[Lost]]:
    hub = LivenessHub("127.0.0.1", world_size, DEAD_AFTER_S, hub_stall_after_s)
    watches, losses = [], []

    def connect(rank: int) -> None:
        lost = Lost()
        losses.append(lost)
        watches.append(
            LeaderWatch(
                "127.0.0.1",
                hub.port,
                hub.token,
                rank=rank,
                dead_after_s=DEAD_AFTER_S,
                timeout_s=5,
                on_lost=lost,
            )
        )

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(1, world_size)]
    for thread in threads:
        thread.start()
    hub.accept_followers(timeout_s=5)
    for thread in threads:
        thread.join(5)
    return hub, watches, losses


def test_beats_keep_both_ends_quiet_and_bye_is_not_a_loss():
    hub, (watch,), (lost,) = linked()
    time.sleep(2 * DEAD_AFTER_S)  # two dead_after_s spells: the beats must carry them
    assert hub.lost is None and lost.message is None
    watch.close()
    hub.close()
    time.sleep(DEAD_AFTER_S)
    assert hub.lost is None and lost.message is None


def test_a_follower_whose_process_ends_is_noticed_at_once():
    hub = LivenessHub("127.0.0.1", 2, DEAD_AFTER_S)
    follower = socket.create_connection(("127.0.0.1", hub.port), timeout=5)
    follower.sendall(HELLO.pack(1, hub.token))
    hub.accept_followers(timeout_s=5)
    assert follower.recv(1) == b"W"
    closed_at = time.monotonic()
    follower.close()  # no BYE: as the kernel closes a killed process's socket
    wait_until(lambda: hub.lost is not None, "rank 0 to notice", DEAD_AFTER_S)
    assert "rank 1 closed the liveness link" in hub.lost
    assert time.monotonic() - closed_at < DEAD_AFTER_S / 2
    hub.close()


def test_a_silent_rank_0_is_noticed_after_dead_after_s():
    silent: list[socket.socket] = []

    def welcome_then_fall_silent(listener: socket.socket) -> None:
        sock = listener.accept()[0]
        sock.recv(HELLO.size)
        sock.sendall(b"W")  # welcomed, then alive but silent, as behind a cut link
        silent.append(sock)

    with socket.create_server(("127.0.0.1", 0)) as listener:
        rank0 = threading.Thread(target=welcome_then_fall_silent, args=(listener,), daemon=True)
        rank0.start()
        lost = Lost()
        watch = LeaderWatch(
            "127.0.0.1", listener.getsockname()[1], b"t" * 16, rank=1, dead_after_s=DEAD_AFTER_S,
            timeout_s=5, on_lost=lost,
        )  # fmt: skip
        silent_at = time.monotonic()
        rank0.join(5)
    wait_until(lambda: lost.message is not None, "the follower to notice", 3 * DEAD_AFTER_S)
    assert lost.message.startswith("rank 1: no heartbeat from rank 0 for")
    assert DEAD_AFTER_S * 0.5 <= lost.at - silent_at <= DEAD_AFTER_S * 2
    assert not watch.alive()
    watch.close()
    silent[0].close()


def test_holding_the_gil_past_dead_after_s_is_no_loss():
    """The issue's case: a tokenizer call held rank 0's GIL for 10-28 s and the follower, hearing
    no beat for leader_dead_after_s, exited. The beats run on a native thread now."""
    hub, (watch,), (lost,) = linked()
    hold_the_gil(3 * int(DEAD_AFTER_S + 0.5))
    time.sleep(DEAD_AFTER_S)  # a loss during the hold is reported as soon as Python runs again
    assert hub.lost is None and lost.message is None and watch.alive()
    watch.close()
    hub.close()


def test_an_interpreter_stuck_past_stall_after_s_stops_its_beats():
    """A beat proves the interpreter ran lately: rank 0's beats stop once its Python has not
    checked in for stall_after_s (here 0.5 s), so a rank hung for good is still found."""
    hub, (watch,), (lost,) = linked(hub_stall_after_s=0.5)
    hold_the_gil(2 * int(DEAD_AFTER_S + 0.5))  # past 0.5 + DEAD_AFTER_S
    wait_until(lambda: lost.message is not None, "the follower to notice", 3 * DEAD_AFTER_S)
    assert lost.message.startswith("rank 1: no heartbeat from rank 0 for")
    watch.close()
    hub.close()


def test_python_beats_where_no_compiler_works_keep_the_same_rules():
    ends = [PythonBeats(sock, DEAD_AFTER_S / 5, DEAD_AFTER_S) for sock in socket.socketpair()]
    time.sleep(2 * DEAD_AFTER_S)
    assert [end.wait(0) for end in ends] == [LIVE, LIVE]
    ends[0].close(bye=True)
    assert ends[1].wait(DEAD_AFTER_S) == ENDED and ends[1].leaving()
    left = [PythonBeats(sock, DEAD_AFTER_S / 5, DEAD_AFTER_S) for sock in socket.socketpair()]
    left[0].close(bye=False)
    assert left[1].wait(DEAD_AFTER_S) == ENDED and not left[1].leaving()
    ends[1].close(bye=False)
    left[1].close(bye=False)


def test_a_wrong_token_is_refused_and_a_rank_once_taken_stays_taken():
    hub = LivenessHub("127.0.0.1", 2, DEAD_AFTER_S)
    with pytest.raises(ConnectionError, match="did not take this rank"):
        accept = threading.Thread(target=hub.accept_followers, args=(3,), daemon=True)
        accept.start()
        LeaderWatch("127.0.0.1", hub.port, b"x" * 16, rank=1, dead_after_s=DEAD_AFTER_S, timeout_s=2)
    watch = LeaderWatch("127.0.0.1", hub.port, hub.token, rank=1, dead_after_s=DEAD_AFTER_S, timeout_s=2)
    accept.join(5)
    with socket.socket() as late, pytest.raises(ConnectionRefusedError):
        late.connect(("127.0.0.1", hub.port))  # every follower came: rank 0 listens no more
    watch.close()
    hub.close()


def test_a_follower_that_never_connects_is_named():
    hub = LivenessHub("127.0.0.1", 3, DEAD_AFTER_S)
    threading.Thread(
        target=LeaderWatch,
        args=("127.0.0.1", hub.port, hub.token),
        kwargs={"rank": 2, "dead_after_s": DEAD_AFTER_S, "timeout_s": 2, "on_lost": Lost()},
        daemon=True,
    ).start()
    with pytest.raises(TimeoutError, match=r"^rank 1 never opened the liveness link within 1s"):
        hub.accept_followers(timeout_s=1)
    hub.close()

"""The liveness link (ranks/liveness.py) in one process over loopback: beats keep both ends quiet, a
peer that ends is noticed at once, a silent one after dead_after_s, BYE is not a loss, and rank 0
takes each follower rank once, with the token, and then listens no more."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from daemon import wait_until

from tpserve.ranks.liveness import LeaderWatch, LivenessHub

DEAD_AFTER_S = 1.5  # beats every 0.3 s: a busy machine's stalls stay well within it


class Lost:
    """A follower's on_lost that records instead of exiting the test process."""

    def __init__(self):
        self.message: str | None = None
        self.at: float | None = None

    def __call__(self, message: str) -> None:
        self.message, self.at = message, time.monotonic()


def linked(world_size: int = 2) -> tuple[LivenessHub, list[LeaderWatch], list[Lost]]:
    hub = LivenessHub("127.0.0.1", world_size, DEAD_AFTER_S)
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
    hub, (watch,), _ = linked()
    closed_at = time.monotonic()
    watch._beater.stop()
    watch._peer.sock.close()  # no BYE: as the kernel closes a killed process's socket
    wait_until(lambda: hub.lost is not None, "rank 0 to notice", DEAD_AFTER_S)
    assert "rank 1 closed the liveness link" in hub.lost
    assert time.monotonic() - closed_at < DEAD_AFTER_S / 2
    hub.close()


def test_a_silent_rank_0_is_noticed_after_dead_after_s():
    hub, (watch,), (lost,) = linked()
    hub._beater.stop()  # alive but silent, as behind a cut link
    silent_at = time.monotonic()
    wait_until(lambda: lost.message is not None, "the follower to notice", 3 * DEAD_AFTER_S)
    assert lost.message.startswith("rank 1: no heartbeat from rank 0 for")
    assert DEAD_AFTER_S * 0.5 <= lost.at - silent_at <= DEAD_AFTER_S * 2
    watch.close()
    hub.close()


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

"""`tpserve serve`: one rank of the daemon, placed by torchrun's environment or by --rank/--master.

Without either, it serves alone at tp=1, or at tp=2 starts the follower here as a child process.
Stop signals are rank 0's to act on: it drains and then sends the followers Stop, so a follower
never ends on a signal while rank 0 may still need it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tpserve.prepare import prepare
from tpserve.ranks.deadline import leave_after
from tpserve.ranks.follow import run_follower
from tpserve.ranks.local_ranks import free_port, local_followers
from tpserve.ranks.logs import setup_logging
from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.startup import leave, start_rank
from tpserve.server.config import ConfigError, add_config_flags, load_config, overrides_from
from tpserve.server.daemon import serve_rank0

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
FOLLOWER_MARGIN_S = 10.0  # past rank 0's grace period, for its last messages and Stop


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    host: str
    port: int
    agent_store: bool  # the store is torchrun's agent's, not rank 0's
    spawn_followers: bool
    local_rank: int  # among the ranks on this host (which GPU it takes)
    local_world_size: int  # ranks on this host


def place(config) -> Placement:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun
        return Placement(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            False,
            int(env.get("LOCAL_RANK", env["RANK"])),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        )
    if config.master:
        host, _, port = config.master.partition(":")
        if config.rank < 0:
            raise ConfigError("--master needs --rank (0 on the host that serves gRPC)")
        try:
            port_number = int(port or DEFAULT_MASTER_PORT)
        except ValueError:
            raise ConfigError(f"--master: {config.master!r} is not HOST[:PORT]") from None
        return Placement(config.rank, config.tp, host, port_number, False, False, 0, 1)  # one per host
    return Placement(0, config.tp, "127.0.0.1", free_port(), False, config.tp > 1, 0, config.tp)


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run one rank of the gRPC daemon (launch.sh starts all)")
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides_from(args))
    placement = place(config)
    setup_logging(placement.rank)
    model_dir = config.model or str(prepare(progress=placement.rank == 0))
    if config.vision:
        # Every rank reads the same config.json and refuses alike, so none waits for a partner.
        model_config = load_model_config(model_dir)
        if model_config.vision is None:
            raise ConfigError(
                f"--vision: the model {Path(model_dir).name} ({model_config.architecture}) has no vision "
                "tower, so it cannot read image inputs; start without --vision or serve a "
                "LlavaForConditionalGeneration model"
            )
    settings = config.engine_settings(model_dir)
    address = (placement.world_size, placement.host, placement.port)
    where = {
        "agent_store": placement.agent_store,
        "local_rank": placement.local_rank,
        "local_world_size": placement.local_world_size,
    }
    if placement.rank > 0:
        wait_for_stop_on_signals(placement.rank, config.grace_s + FOLLOWER_MARGIN_S)
        leave(run_follower(settings, placement.rank, *address, **where))
    with ExitStack() as stack:
        if placement.spawn_followers:
            # The followers inherit ignored stop signals: Ctrl-C reaches this whole process group,
            # and rank 0 alone decides when they stop (Stop after the drain, or its own death).
            with ignoring(signal.SIGINT, signal.SIGTERM):
                stack.enter_context(local_followers(settings, placement.port))
        runtime = start_rank(settings, 0, *address, **where)
        code = serve_rank0(config, runtime, runtime.settings)
    leave(code)


@contextmanager
def ignoring(*signums: int) -> Iterator[None]:
    """Ignore the signals inside; processes started inside keep ignoring them (POSIX exec rule,
    which Python honours for SIGINT too)."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def wait_for_stop_on_signals(rank: int, patience_s: float) -> None:
    """A follower leaves when rank 0 sends Stop. torchrun forwards SIGTERM and SIGINT to every rank
    at once, and rank 0 first drains its live streams, which need this follower; so a signal here
    starts a countdown instead, which ends the process (exit 1) only if rank 0's Stop never comes
    (rank 0 died, or the link to it is down, while this rank waited, idle, on the store)."""
    signums = {signal.SIGINT, signal.SIGTERM}
    started: list[int] = []
    lock = threading.RLock()  # the main thread's handler may run inside it

    def start_countdown(signum: int) -> None:
        with lock:
            if started:
                return
            started.append(signum)
            leave_after(
                patience_s, f"rank {rank}: no Stop from rank 0 within {patience_s:.0f} s of the stop signal"
            )
        log.warning(
            "rank %d: got %s; waiting up to %.0f s for rank 0 to drain and send Stop",
            rank,
            signal.Signals(signum).name,
            patience_s,
        )

    def watch() -> None:
        while True:
            start_countdown(signal.sigwait(signums))

    def watch_wakeups(wakeups: socket.socket, wakeup_end: socket.socket) -> None:
        # Holds wakeup_end too: the interpreter writes to its descriptor, which must stay open.
        while True:
            signum = wakeups.recv(1)[0]
            if signum in signums:
                start_countdown(signum)

    # Python runs signal handlers on the main thread only, between bytecodes, and a follower's
    # main thread sits for long spells in a collective or a store wait. Blocked there (and in
    # every thread started from now on), the signals reach the watcher, which hears them at once.
    signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    # Should one land on a thread started earlier, its Python handler would wait for the main
    # thread; the interpreter's C handler also writes the signal's number to the wakeup socket at
    # once, from whatever thread, and a second watcher hears it there.
    wakeups, wakeup_end = socket.socketpair()
    wakeup_end.setblocking(False)
    signal.set_wakeup_fd(wakeup_end.fileno(), warn_on_full_buffer=False)
    threading.Thread(
        target=watch_wakeups, args=(wakeups, wakeup_end), name="stop-wakeups", daemon=True
    ).start()
    for signum in signums:
        signal.signal(signum, lambda received, frame: start_countdown(received))

"""`tpserve serve`: one rank of the daemon, placed by torchrun's environment or by --rank/--master.

Without either, it serves alone at tp=1, or at tp=2 starts the follower here as a child process.
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from dataclasses import dataclass

from tpserve.prepare import prepare
from tpserve.ranks.follow import run_follower
from tpserve.ranks.local_ranks import free_port, local_followers
from tpserve.ranks.logs import setup_logging
from tpserve.ranks.startup import start_rank
from tpserve.server.config import ConfigError, add_config_flags, load_config, overrides_from
from tpserve.server.daemon import serve_rank0

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    host: str
    port: int
    agent_store: bool  # the store is torchrun's agent's, not rank 0's
    spawn_followers: bool


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
        )
    if config.master:
        host, _, port = config.master.partition(":")
        if config.rank < 0:
            raise ConfigError("--master needs --rank (0 on the host that serves gRPC)")
        try:
            port_number = int(port or DEFAULT_MASTER_PORT)
        except ValueError:
            raise ConfigError(f"--master: {config.master!r} is not HOST[:PORT]") from None
        return Placement(config.rank, config.tp, host, port_number, False, False)
    return Placement(0, config.tp, "127.0.0.1", free_port(), False, config.tp > 1)


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run one rank of the gRPC daemon (launch.sh starts all)")
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides_from(args))
    placement = place(config)
    setup_logging(placement.rank)
    model_dir = config.model or str(prepare(progress=placement.rank == 0))
    settings = config.engine_settings(model_dir)
    if placement.rank > 0:
        return run_follower(
            settings,
            placement.rank,
            placement.world_size,
            placement.host,
            placement.port,
            placement.agent_store,
        )
    followers = local_followers(settings, placement.port) if placement.spawn_followers else nullcontext()
    with followers:
        runtime = start_rank(
            settings,
            0,
            placement.world_size,
            placement.host,
            placement.port,
            agent_store=placement.agent_store,
        )
        return serve_rank0(config, runtime, model_dir)

"""engines.follow: what every rank above 0 runs — receive rank 0's messages and apply them.

Returns 0 on Stop. Anything else that ends the loop (rank 0 lost, a collective failed, a pass that
raised) propagates, and the process exits non-zero so a supervisor restarts both ranks.
"""

from __future__ import annotations

import contextlib
import logging

from tpserve.ranks.apply import VotedDown, apply_message
from tpserve.ranks.engine import Engine
from tpserve.ranks.errors import UserError
from tpserve.ranks.logs import setup_logging
from tpserve.ranks.startup import shutdown, start_rank
from tpserve.ranks.wire_messages import Stop

log = logging.getLogger(__name__)


def follow(engine: Engine, channel) -> int:
    while True:
        msg = channel.receive()
        if isinstance(msg, Stop):
            log.info("follower: stop received")
            return 0
        # A refusal was voted by every rank, and every rank rolled back the same way.
        with contextlib.suppress(VotedDown):
            apply_message(engine, channel, msg)


def run_follower(settings, rank: int, world_size: int, host: str, port: int, **placement) -> int:
    """A follower process from start to exit code: start-up, follow, clean exit on Stop.
    `placement`: start_rank's keywords (agent_store, local_rank, local_world_size)."""
    setup_logging(rank)
    try:
        runtime = start_rank(settings, rank, world_size, host, port, **placement)
    except UserError as error:
        log.error("%s", error)
        return 2
    try:
        code = follow(runtime.engine, runtime.channel)
    except Exception as error:  # rank 0 lost, a collective failed: let a supervisor restart us
        log.error("follower stopping: %s: %s", type(error).__name__, error)
        return 1
    shutdown(runtime)
    return code

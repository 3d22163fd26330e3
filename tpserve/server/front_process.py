"""The front process: both APIs, tokenizing, chat templates, detokenizing and stop strings, apart
from rank 0's engine loop (its scheduler, the leader, the wire, the heartbeat), as vLLM v1 runs its
API server apart from its engine core.

Rank 0 starts it (`python -m tpserve.server.front_process FD`, tpserve/server/front_link.py) with one end
of a socket pair; the first message is the FrontSpec. Its life is rank 0's to decide: it ignores
SIGTERM and SIGINT (a signal to the process group reaches rank 0, which drains and then sends
StopApis), and it exits when rank 0 says so or when rank 0's end closes (exit 1: the engine is gone,
and for BROKEN_FLUSH_S before that new requests hear UNAVAILABLE, as a broken rank 0 answers).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import sys
import time
from multiprocessing.connection import Connection

from tpserve.ranks.errors import UserError
from tpserve.ranks.logs import setup_logging
from tpserve.server.apis import LocalApis
from tpserve.server.front_wire import (
    ApisStopped,
    BeginStopping,
    FrontSpec,
    Ready,
    StartFailed,
    StopApis,
)
from tpserve.server.heap import return_large_frees_to_the_system
from tpserve.server.kv_blocks import BlockStats
from tpserve.server.remote_engine import RemoteEngine
from tpserve.server.requests import HostStats
from tpserve.server.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SPEC_TIMEOUT_S = 60.0  # rank 0 sends the spec as soon as it started this process
BROKEN_FLUSH_S = 2.0  # as rank 0's daemon: a moment of clear refusals before the ports close
FLUSH_S = 1.0
CONTROL_POLL_S = 0.5


def serve_front(conn: Connection) -> int:
    if not conn.poll(SPEC_TIMEOUT_S):
        log.error("rank 0 sent no spec within %.0f s", SPEC_TIMEOUT_S)
        return 1
    spec: FrontSpec = conn.recv()
    info = spec.info
    return_large_frees_to_the_system()
    # The chat template rank 0's config names (--chat-template), as an in-process daemon reads it.
    tokenizer = Tokenizer.from_model_dir(spec.model_dir, chat_template=spec.config.chat_template or None)
    engine = RemoteEngine(
        conn,
        tokenizer.decode,
        spec.eos_ids,
        HostStats(queued=0, lanes_busy=0, room_used=0, num_lanes=info.num_lanes, room=info.room),
        BlockStats(0, 0, 0, 0, 0, 0, 0, 1),
        detokenize_special=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    engine.start()
    apis = LocalApis(spec.config, engine, tokenizer, info)
    try:
        http_port, port = apis.start()
    except Exception as error:
        log.error("the APIs could not start: %s", error)
        apis.stop(grace_s=0)
        conn.send(StartFailed(str(error), isinstance(error, UserError)))
        return 1
    conn.send(Ready(port, http_port))
    return _serve_until_told(engine, apis, conn)


def _serve_until_told(engine: RemoteEngine, apis: LocalApis, conn: Connection) -> int:
    while True:
        try:
            control = engine.controls.get(timeout=CONTROL_POLL_S)
        except queue.Empty:
            if engine.gone.is_set():
                # Rank 0 ended without StopApis: it broke or was killed. Say so briefly, then go.
                time.sleep(BROKEN_FLUSH_S)
                apis.stop(grace_s=FLUSH_S)
                return 1
            continue
        if isinstance(control, BeginStopping):
            apis.begin_stopping()
        elif isinstance(control, StopApis):
            apis.stop(grace_s=control.grace_s)
            with contextlib.suppress(OSError):  # rank 0 did not wait
                conn.send(ApisStopped())
            return 0


def main() -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    setup_logging(0)
    # Never closed here: the engine-read thread may be inside recv; the process's exit closes it.
    return serve_front(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    sys.exit(main())

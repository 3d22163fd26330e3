"""Rank 0's end of the front process: starts it, serves its requests on the lane host, sends back
what each step produced, and says when it is gone.

The front (tpserve/server/front_process.py) runs the APIs, tokenizing and detokenizing in a process of its
own, so none of that holds the engine loop's interpreter (its GIL). Here, on the engine's side:
- one thread reads the front's messages: Submit (the lane host's submit, its refusal answered at
  once), Cancel, Ask (stats for metrics), Ready / StartFailed / ApisStopped;
- one thread sends every stream's news (its tokens, bare: the lane host makes no text) in one
  StepOut per scheduling step, woken by the lane host's on_step, or after POLL_S for what ends
  between steps;
- a front that goes away calls on_lost (the daemon fails the lane host and exits 1, so both ranks
  exit and a supervisor restarts all three).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection

from tpserve.ranks.errors import UserError
from tpserve.server.front_wire import (
    BLOCK_STATS,
    INVALID,
    QUEUE_FULL,
    UNAVAILABLE,
    Answer,
    ApisStopped,
    Ask,
    BeginStopping,
    Cancel,
    FrontSpec,
    Ready,
    StartFailed,
    StepOut,
    StopApis,
    StreamOut,
    Submit,
    SubmitAnswer,
)
from tpserve.server.grammar import Grammars
from tpserve.server.lane_host import LaneHost
from tpserve.server.lane_stream import Stream
from tpserve.server.requests import Finished, HostUnavailable, Prefilled, QueueFull, TokenDelta

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the front's imports, tokenizer and ports, on a busy two-core machine
POLL_S = 0.05  # the sender's wake-up without a step; the reader's check for being closed
EXIT_WAIT_S = 10.0  # the front's exit after ApisStopped (or after a StopApis it never answered)


class FrontLink:
    def __init__(self, spec: FrontSpec, grammars: Grammars, on_lost: Callable[[str], None]):
        self._spec = spec
        self._grammars = grammars  # rebuilds each request's grammar here, where its matcher runs
        self._on_lost = on_lost
        self._host: LaneHost | None = None
        self._conn: Connection | None = None
        self._process: subprocess.Popen | None = None
        self._send_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one drain-and-send at a time, so events keep their order
        self._cond = threading.Condition()
        self._streams: dict[int, Stream] = {}
        self._news: set[int] = set()  # streams with events not yet sent
        self._flush = False
        self._closing = False  # the front's end of the socket closing is expected from now on
        self._ready = threading.Event()
        self._ready_value: Ready | StartFailed | None = None
        self._stopped = threading.Event()
        self._sent_broken: str | None = None
        self.lost: str | None = None  # why the front went away, once it did (not after stop())

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def attach(self, host: LaneHost) -> None:
        """The lane host this link serves (built with on_step=link.step_done and no detokenizer)."""
        self._host = host

    def start(self, timeout_s: float = START_TIMEOUT_S) -> tuple[int | None, int]:
        """Start the front process and both threads; (HTTP port or None, gRPC port) once the front
        serves both APIs; RuntimeError if it cannot."""
        self._spawn()
        return self._wait_ready(timeout_s)

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tpserve.server.front_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send(self._spec)
        threading.Thread(target=self._read, name="front-read", daemon=True).start()
        threading.Thread(target=self._write, name="front-write", daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> tuple[int | None, int]:
        """(HTTP port or None, gRPC port) once the front serves; RuntimeError if it cannot."""
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the front process did not start its APIs within {timeout_s:.0f} s")
        ready = self._ready_value
        if isinstance(ready, StartFailed):
            raise (UserError if ready.user_error else RuntimeError)(ready.error)
        if not isinstance(ready, Ready):
            raise RuntimeError("the front process ended before its APIs started")
        return ready.http_port, ready.port

    def step_done(self) -> None:
        """On the scheduling thread after each step: send what it produced, now, in one message."""
        with self._cond:
            if self._news:
                self._flush = True
                self._cond.notify()

    def begin_stopping(self) -> None:
        """New requests hear UNAVAILABLE "the server is stopping" on both APIs; live ones go on."""
        try:
            self._flush_now()
            self._send(BeginStopping())
        except OSError:
            pass  # the front is gone: the reader has said so

    def stop(self, grace_s: float) -> None:
        """Send the last events, then StopApis; wait for the front to close its ports and exit."""
        self._closing = True
        if self._conn is None:
            return
        try:
            self._flush_now()
            self._send(StopApis(grace_s))
        except OSError:
            pass  # already gone
        self._stopped.wait(grace_s + EXIT_WAIT_S)
        self.close()

    def close(self) -> None:
        """End the front process (it exits by itself once its socket closes; killed if it lingers)."""
        self._closing = True
        if self._process is None:
            return
        if self._conn is not None:
            self._conn.close()
        try:
            self._process.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            log.error("the front process did not exit within %.0f s; killing it", EXIT_WAIT_S)
            self._process.kill()
            self._process.wait(timeout=EXIT_WAIT_S)

    # ---- the front's messages ----

    def _read(self) -> None:
        conn = self._conn
        try:
            while True:
                if conn.poll(POLL_S * 10):  # raises OSError once close() closed it
                    self._handle(conn.recv())
        except (EOFError, OSError) as error:
            if not self._closing:
                self._lost(f"the front process went away ({type(error).__name__})")
        finally:
            self._ready.set()
            self._stopped.set()

    def _handle(self, message) -> None:
        host = self._host
        if isinstance(message, Submit):
            self._submit(host, message)
        elif isinstance(message, Cancel):
            with self._cond:
                stream = self._streams.get(message.stream_id)
            if stream is not None:
                stream.cancel()
        elif isinstance(message, Ask):
            value = host.block_stats() if message.what == BLOCK_STATS else host.stats()
            self._send(Answer(message.ask_id, value))
        elif isinstance(message, (Ready, StartFailed)):
            self._ready_value = message
            self._ready.set()
        elif isinstance(message, ApisStopped):
            self._stopped.set()
        else:
            log.error("the front process sent %r, which the engine does not know", type(message).__name__)

    def _submit(self, host: LaneHost, message: Submit) -> None:
        request = message.request
        refusal, text = None, ""
        try:
            if message.grammar_text is not None:
                request = replace(request, grammar=self._grammars.rebuild(message.grammar_text))
            stream = host.submit(request)
        except QueueFull as error:
            refusal, text = QUEUE_FULL, str(error)
        except HostUnavailable as error:
            refusal, text = UNAVAILABLE, str(error)
        except ValueError as error:
            refusal, text = INVALID, str(error)
        if refusal is None:
            with self._cond:
                self._streams[message.stream_id] = stream
            stream.listen(lambda: self._has_news(message.stream_id))
        self._send(SubmitAnswer(message.stream_id, refusal, text, self._broken()))

    def _has_news(self, stream_id: int) -> None:
        with self._cond:
            self._news.add(stream_id)

    # ---- what the engine produced ----

    def _write(self) -> None:
        try:
            while not self._closing:
                with self._cond:
                    self._cond.wait_for(lambda: self._flush or self._closing, POLL_S)
                self._flush_now()
        except OSError:
            return  # the reader reports the front gone

    def _flush_now(self) -> None:
        with self._flush_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        with self._cond:
            news, self._news, self._flush = self._news, set(), False
            streams = [(stream_id, self._streams.get(stream_id)) for stream_id in sorted(news)]
        outs = [out for stream_id, stream in streams if stream and (out := self._drain(stream_id, stream))]
        broken = self._broken()
        if outs or broken != self._sent_broken:
            self._sent_broken = broken
            self._send(StepOut(tuple(outs), broken))

    def _drain(self, stream_id: int, stream: Stream) -> StreamOut | None:
        prefilled, token_ids, logprobs, finished = None, [], [], None
        for event in stream.next_events(0):
            if isinstance(event, Prefilled):
                prefilled = event
            elif isinstance(event, TokenDelta):  # one bare token (tpserve/server/reply_text.py RawReply)
                token_ids += event.token_ids
                logprobs += event.logprobs or [None] * len(event.token_ids)
            elif isinstance(event, Finished):
                finished = event
        if finished is not None:
            with self._cond:
                self._streams.pop(stream_id, None)
        if prefilled is None and not token_ids and finished is None:
            return None
        asked = any(lp is not None for lp in logprobs)
        return StreamOut(stream_id, prefilled, tuple(token_ids), tuple(logprobs) if asked else (), finished)

    def _broken(self) -> str | None:
        host = self._host
        return host.broken_reason if host is not None else None

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _lost(self, reason: str) -> None:
        self.lost = reason
        log.error("%s: failing the engine so both ranks exit", reason)
        self._on_lost(reason)

"""The HTTP API's connections under uvicorn's h11 protocol, with what uvicorn leaves out: TCP_NODELAY,
a deadline for each request's head, a bound on open connections, and an end to a stalled write.

- TCP_NODELAY: asyncio sets it only on sockets created with proto IPPROTO_TCP, and a listening
  socket from socket.create_server has proto 0; without it a reply's second write (uvicorn writes
  the head, then the body) waits for the client's delayed ACK, ~40 ms per request on a kept-alive
  connection.
- A request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the request's first byte: uvicorn arms its keep-alive timer only after
  a response, so a connection that sends nothing, or a byte at a time, was held for ever (slow
  loris). Dribbling bytes does not move the deadline.
- Past `max_connections` open connections a new one gets a 503 error object and is closed.
- Bytes h11 cannot read as HTTP/1.1 (a bad request line or header, a bad chunk, a head past h11's
  buffer) get a 400 error object and the connection closes, where uvicorn answers plain text. When
  the app has already begun its reply (it answered without reading the body, and the body then
  turned bad) there is no room for a second one: the connection just closes. Either way the app's
  cycle is told the client left, or its own reply would meet h11 in MUST_CLOSE and log a traceback
  at ERROR level.
- A client that stops reading: once the reply's bytes fill the socket and asyncio's buffer (its
  high-water mark, 64 KiB), uvicorn pauses the app's writes; a connection paused for
  `write_stall_s` is aborted (its stream is then cancelled as for any disconnect). The reply
  generates no further meanwhile past max_unread_tokens (tpserve/server/lane_stream.py).

Idle kept-alive connections close after `keep_alive_s` (uvicorn's timeout_keep_alive); a body that
stalls is the app's to time out (tpserve/server/http_body.py), since only the app reads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tpserve.server.http_errors import error_json

log = logging.getLogger(__name__)

TOO_MANY_CONNECTIONS = "the server has too many open connections ({limit}); try again later"
NOT_HTTP = "the request is not valid HTTP/1.1"


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0  # for a request's head, from its first byte (or the connection)
    body_timeout_s: float = 30.0  # for a request's whole body, once its head arrived
    keep_alive_s: float = 5.0  # an idle kept-alive connection closes after this
    max_connections: int = 1024  # open at once; more are answered 503 and closed
    write_stall_s: float = 30.0  # a connection whose writes stay paused (client not reading) this long closes


class GuardedH11Protocol(H11Protocol):
    limits = HttpLimits()  # set per server by protocol_with

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._write_stall: asyncio.TimerHandle | None = None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.connections) > self.limits.max_connections:
            self._refuse_connection(transport)
            return
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Their state leaves IDLE once h11 has read a whole request head.
        if self.conn.their_state is h11.IDLE:
            self._arm_head_deadline()
        else:
            self._disarm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        self._disarm_write_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(self.limits.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write_stall()

    def _disarm_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _write_stalled(self) -> None:
        self._write_stall = None
        log.info("closed an HTTP connection whose client read nothing for %g s", self.limits.write_stall_s)
        self.transport.abort()  # close() would wait for the unread bytes to drain

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None and not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.limits.header_timeout_s, self._head_too_late)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info(
                "closed an HTTP connection whose request head took over %g s", self.limits.header_timeout_s
            )
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 could not read (`msg` is its plain-text wording)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() says the client left; its send() is dropped
            self.cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(_error_reply(400, "Bad Request", NOT_HTTP))
        self.transport.close()

    def _refuse_connection(self, transport: asyncio.Transport) -> None:
        message = TOO_MANY_CONNECTIONS.format(limit=self.limits.max_connections)
        transport.write(_error_reply(503, "Service Unavailable", message))
        transport.close()


def _error_reply(status: int, reason: str, message: str) -> bytes:
    """A whole closing reply with an error object, written past h11 (its state may allow none)."""
    body = json.dumps(error_json(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def protocol_with(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn builds each connection from, with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})

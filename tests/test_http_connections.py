"""The HTTP server's connections (tpserve/server/http_connections.py), on a real uvicorn over loopback with a
small app: TCP_NODELAY on every accepted socket, a request head's deadline (a silent or dribbling
client is closed, a prompt one served), kept-alive connections closed when idle, the bound on
open connections answered with a 503 error object, a client that stops reading a stream cut off
at the write-stall timeout while one that reads gets it whole, and bytes that are not HTTP/1.1 answered
with a 400 error object (or, once a reply has begun, a close) and no traceback."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest
from daemon import wait_until
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tpserve.server.http_connections import NOT_HTTP, HttpLimits
from tpserve.server.http_server import HttpServer

LIMITS = HttpLimits(
    header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=1.0, max_connections=4, write_stall_s=1.0
)
STREAM_CHUNKS = 400  # 400 x 1.3 KB: more than a small receive buffer and asyncio's 64 KiB hold
CLOSE_WITHIN_S = 30.0  # generous: the close is due after 1 s, on a busy machine


async def hello(request):
    return JSONResponse({"hello": "world"})


READING = threading.Event()  # set once /echo has begun reading its body


async def early(request):
    return JSONResponse({"answered": "before the body"})


async def echo(request):
    READING.set()
    try:
        return JSONResponse({"length": len(await request.body())})
    except ClientDisconnect:  # as the daemon's routes do (tpserve/server/http_api.py)
        return JSONResponse({}, status_code=499)


async def stream(request):
    async def chunks():
        for index in range(STREAM_CHUNKS):
            yield f"{index:04d}" + "x" * 1300 + "\n"

    return StreamingResponse(chunks())


@pytest.fixture
def server():
    routes = [
        Route("/hello", hello),
        Route("/stream", stream),
        Route("/early", early, methods=["POST"]),
        Route("/echo", echo, methods=["POST"]),
    ]
    http = HttpServer(Starlette(routes=routes), limits=LIMITS)
    http.start()
    try:
        yield http
    finally:
        http.stop(grace_s=0.0)


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=CLOSE_WITHIN_S)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Reads until the server closes (True) or the socket's timeout passes (False)."""
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def accepted_sockets(server) -> list[socket.socket]:
    connections = server._server.server_state.connections
    return [protocol.transport.get_extra_info("socket") for protocol in connections]


def test_every_accepted_connection_has_tcp_nodelay(server):
    with httpx.Client() as client:
        assert client.get(f"http://127.0.0.1:{server.port}/hello").json() == {"hello": "world"}
        (sock,) = accepted_sockets(server)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_silent_or_dribbling_client_is_closed_and_a_prompt_one_is_served(server):
    silent = connect(server)
    dribbling = connect(server)
    dribbling.sendall(b"GET /hello HTTP/1.1\r\n")
    started = time.monotonic()
    for _ in range(3):  # bytes keep coming, but the head's deadline does not move
        time.sleep(0.4)
        dribbling.sendall(b"x")
    with httpx.Client() as client:  # meanwhile serving goes on
        assert client.get(f"http://127.0.0.1:{server.port}/hello").status_code == 200
    assert closed_by_server(silent) and closed_by_server(dribbling)
    assert time.monotonic() - started >= LIMITS.header_timeout_s


def test_an_idle_kept_alive_connection_is_closed(server):
    sock = connect(server)
    sock.sendall(b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
    reply = b""
    while b"world" not in reply:  # the head and the body may come as two segments
        reply += sock.recv(65536)
    assert closed_by_server(sock)


def test_past_the_connection_limit_a_new_one_gets_a_503_error_object(server):
    held = [connect(server) for _ in range(LIMITS.max_connections)]
    wait_until(lambda: len(accepted_sockets(server)) == LIMITS.max_connections, "the connections", 10)
    response = httpx.get(f"http://127.0.0.1:{server.port}/hello", timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        "the server has too many open connections (4); try again later"
    )
    for sock in held:
        sock.close()
    wait_until(lambda: not accepted_sockets(server), "the held connections to close", 10)
    assert httpx.get(f"http://127.0.0.1:{server.port}/hello", timeout=10).status_code == 200


def test_a_client_that_stops_reading_is_cut_off_at_the_write_stall_timeout(server):
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)  # keeps the server's send buffer small
    stalled.settimeout(CLOSE_WITHIN_S)
    stalled.connect(("127.0.0.1", server.port))
    stalled.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_until(lambda: accepted_sockets(server), "the connection", CLOSE_WITHIN_S)
    wait_until(lambda: not accepted_sockets(server), "the stalled connection to close", CLOSE_WITHIN_S)
    received = b""
    try:
        while chunk := stalled.recv(65536):
            received += chunk
    except ConnectionResetError:  # aborted, its unsent bytes dropped
        pass
    assert received.startswith(b"HTTP/1.1 200 ") and f"{STREAM_CHUNKS - 1:04d}".encode() not in received
    with httpx.Client(timeout=CLOSE_WITHIN_S) as client:  # a client that reads gets it whole
        assert client.get(f"http://127.0.0.1:{server.port}/stream").text.count("\n") == STREAM_CHUNKS


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def error_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


CHUNKED = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
NOT_HTTP_REQUESTS = [
    b"garbage\r\n\r\n",
    b"GET /hello HTTP/1.1\r\n\r\n",  # no host
    b"GET /hello HTTP/1.1\r\nhost: x\r\na header line with no colon\r\n\r\n",
    b"GET /h\xffllo HTTP/1.1\r\nhost: x\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello",
    CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n",  # a chunk size that is not hex
    b"GET /hello HTTP/1.1\r\nhost: x\r\nx: " + b"a" * 100_000,  # a head past h11's buffer
]


@pytest.mark.parametrize("raw", NOT_HTTP_REQUESTS, ids=range(len(NOT_HTTP_REQUESTS)))
def test_bytes_that_are_not_http_get_a_400_error_object_and_no_traceback(server, raw, caplog):
    sock = connect(server)
    sock.sendall(raw)
    head, _, body = read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head
    assert json.loads(body)["error"] == {
        "message": NOT_HTTP,
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert error_lines(caplog) == []
    assert httpx.get(f"http://127.0.0.1:{server.port}/hello").status_code == 200


def test_a_body_that_turns_bad_while_the_app_reads_it_gets_a_400_and_no_traceback(server, caplog):
    READING.clear()
    sock = connect(server)
    sock.sendall(CHUNKED + b"5\r\nhello\r\n")
    assert READING.wait(CLOSE_WITHIN_S)
    sock.sendall(b"zz\r\n")
    reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400 ") and NOT_HTTP.encode() in reply
    assert b'"length"' not in reply  # the app's own reply, once it saw the client leave, is dropped
    time.sleep(0.2)  # the app's task ends after the close; a traceback would be logged then
    assert error_lines(caplog) == []


def test_a_body_that_turns_bad_after_the_reply_only_closes_the_connection(server, caplog):
    sock = connect(server)
    sock.sendall(CHUNKED.replace(b"/echo", b"/early") + b"5\r\nhello\r\n")
    reply = b""
    while b"before the body" not in reply:
        reply += sock.recv(65536)
    sock.sendall(b"zz\r\n")  # no room for a second reply
    assert read_until_closed(sock) == b"" and error_lines(caplog) == []
    assert httpx.get(f"http://127.0.0.1:{server.port}/hello").status_code == 200

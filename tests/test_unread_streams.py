"""A client that stops reading a stream, against the real daemon (two ranks, gloo, loopback): once its
connection's buffers are full, at most max_unread_tokens more wait unread before the reply is
cancelled and its lane freed; gRPC ends the call RESOURCE_EXHAUSTED naming the bound, HTTP closes
the connection once its writes stalled for http_write_stall_s; serving goes on beside it.

The clients keep their buffers small (a 4 KiB gRPC window, a small TCP receive buffer and segment
size) and ask for 20 log probabilities per token, so a reply of a few hundred tokens outgrows them.
"""

from __future__ import annotations

import json
import socket

import grpc
import pytest
from daemon import SERVING, BackgroundReply, running_daemon, wait_until, write_daemon_model

from tpserve.server.submitter import UNREAD_OVERFLOW
from tpserve.v1 import serving_pb2, serving_pb2_grpc

MAX_UNREAD_TOKENS = 64  # well above what a reading client lags by, well below the reply
WRITE_STALL_S = 3.0
MAX_TOKENS = 400
OVERFLOW_LOG = "cancelled a reply whose client stopped reading"
STALL_LOG = "closed an HTTP connection whose client read nothing"
# grpc's client window: 4 KiB of lookahead, not grown by bandwidth probes
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("unread-model"))
    args = (
        "--context", "512", "--lanes", "2", "--max-unread-tokens", str(MAX_UNREAD_TOKENS),
        "--http-write-stall-s", str(WRITE_STALL_S),
    )  # fmt: skip
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("unread-logs"), *args) as served:
        yield served


def errors_in(daemon) -> list[str]:
    return [line for line in daemon.logs().splitlines() if "Traceback" in line or " ERROR " in line]


def serving_goes_on(daemon) -> None:
    request = serving_pb2.GenerateRequest(prompt="hi", max_tokens=20, ignore_eos=True)
    reply = BackgroundReply(daemon.stub, request).join(timeout_s=120)
    assert reply.ok and len(reply.token_ids) == 20
    assert daemon.health() == SERVING and errors_in(daemon) == []


def test_a_grpc_stream_whose_client_stops_reading_ends_resource_exhausted(daemon):
    overflows = daemon.logs().count(OVERFLOW_LOG)
    with grpc.insecure_channel(daemon.target, options=SMALL_WINDOW) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        request = serving_pb2.GenerateRequest(
            prompt="go", max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20
        )
        call = stub.Generate(request, timeout=300)
        next(call)  # the reply runs; this client reads no more for now
        wait_until(lambda: daemon.logs().count(OVERFLOW_LOG) > overflows, "the unread reply's cancel", 120)
        daemon.wait_idle(timeout_s=60)  # its lane is free, though the client never read on
        tokens = 0
        with pytest.raises(grpc.RpcError) as raised:
            for response in call:  # what the connection held, then the status
                tokens += len(response.token_ids)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.details() == UNREAD_OVERFLOW.format(limit=MAX_UNREAD_TOKENS)
    assert tokens < MAX_TOKENS - MAX_UNREAD_TOKENS
    serving_goes_on(daemon)


def test_an_http_stream_whose_client_stops_reading_is_cancelled_and_closed(daemon):
    overflows, stalls = daemon.logs().count(OVERFLOW_LOG), daemon.logs().count(STALL_LOG)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)  # keeps the server's send buffer small
    sock.settimeout(60)
    sock.connect(("127.0.0.1", daemon.http_port))
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)  # and reads nothing
    wait_until(lambda: daemon.logs().count(OVERFLOW_LOG) > overflows, "the unread reply's cancel", 120)
    daemon.wait_idle(timeout_s=60)
    wait_until(lambda: daemon.logs().count(STALL_LOG) > stalls, "the stalled connection's close", 60)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # aborted: the server's unsent bytes were dropped
    sock.close()
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" not in received  # cut off, not finished
    serving_goes_on(daemon)

"""What a hostile client can do to the gRPC port below the level of calls, against the real daemon
(two ranks, gloo, loopback): bytes that are not HTTP/2, connections that send a few bytes and stall,
a message of 100 MB. What must hold: a live stream goes on and ends whole, other clients are
served during and after, the garbage is closed, the oversized message is refused naming the limit.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from daemon import (
    SERVING,
    BackgroundReply,
    launch,
    read_reply,
    running_daemon,
    wait_until,
    write_daemon_model,
)
from test_hostile_clients import figures, tracebacks
from test_http_connections import closed_by_server

from tpserve.server.grpc_server import EXTRA_WORKERS
from tpserve.server.submitter import QUEUE_FULL
from tpserve.v1 import serving_pb2, serving_pb2_grpc

HANDSHAKE_TIMEOUT_S = 3.0
KEEPALIVE_S = 2.0
LANES, QUEUE_SIZE = 2, 2
MAX_RUNNING = LANES + QUEUE_SIZE + EXTRA_WORKERS  # the gRPC calls that may run at once
CLOSE_WITHIN_S = 60.0  # generous: a close is due seconds earlier, on a busy machine
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GARBAGE = {
    "http1": b"POST /tpserve.v1.Serving/Generate HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc",
    "tls hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) * 2,
    "random": random.Random(0).randbytes(64 << 10),
    "zeros": bytes(64 << 10),
    # A correct preface, then frames of no known shape: past the connect string, into the framer.
    "bad frames": PREFACE + random.Random(1).randbytes(16 << 10),
}
STALLED = [b"", b"P", b"PRI * HTTP/2.0\r\n", PREFACE, PREFACE + b"\x00\x00\x12\x04"]
LIVE = serving_pb2.GenerateRequest(prompt="go", max_tokens=120, ignore_eos=True)
SHORT = serving_pb2.GenerateRequest(prompt="hello", max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("transport-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    args = (
        *("--context", "256", "--lanes", str(LANES), "--queue-size", str(QUEUE_SIZE)),
        *("--grpc-handshake-timeout-s", str(HANDSHAKE_TIMEOUT_S), "--grpc-keepalive-s", str(KEEPALIVE_S)),
    )
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("transport-logs"), *args) as served:
        yield served


def send_garbage(address, data: bytes) -> socket.socket:
    sock = socket.create_connection(address, timeout=CLOSE_WITHIN_S)
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # closed before it had it all
        sock.sendall(data)
    return sock


def served_by_a_fresh_client(daemon) -> list[int]:
    """A short reply on a channel of its own, as another user's client would open."""
    with grpc.insecure_channel(daemon.target) as channel:
        reply = read_reply(serving_pb2_grpc.ServingStub(channel).Generate(SHORT, timeout=60))
    assert reply.ok, (reply.code, reply.details)
    return reply.token_ids


def test_garbage_and_stalled_connections_on_the_grpc_port_leave_every_client_served(daemon):
    address = ("127.0.0.1", daemon.port)
    solo = read_reply(daemon.stub.Generate(LIVE, timeout=60)).token_ids
    short = served_by_a_fresh_client(daemon)
    live = BackgroundReply(daemon.stub, LIVE, timeout_s=120)
    live.wait_tokens(1, timeout_s=60)
    stalled = [send_garbage(address, data) for data in STALLED * 20]
    garbage = {name: send_garbage(address, data) for name, data in GARBAGE.items()}
    # While the stalled ones are held open: other clients are served and the live stream goes on.
    assert served_by_a_fresh_client(daemon) == short
    assert {name: closed_by_server(sock) for name, sock in garbage.items()} == dict.fromkeys(GARBAGE, True)
    assert served_by_a_fresh_client(daemon) == short
    reply = live.join(timeout_s=120)
    assert reply.ok and reply.token_ids == solo
    # A connection that never finishes its HTTP/2 handshake is closed at the configured timeout.
    assert all(closed_by_server(sock) for sock in stalled)
    for sock in [*stalled, *garbage.values()]:
        sock.close()
    assert served_by_a_fresh_client(daemon) == short
    assert daemon.health() == SERVING and tracebacks(daemon) == []
    figures("grpc garbage", garbage=len(garbage), stalled=len(stalled))


def test_a_100_mb_grpc_message_is_refused_naming_the_limit_and_serving_goes_on(daemon):
    huge = serving_pb2.GenerateRequest(prompt="a" * (100 << 20), max_tokens=2).SerializeToString()
    limit = 4 << 20  # no --vision: a context of text fits with room to spare (tpserve/server/request_size.py)
    method = "/tpserve.v1.Serving/Generate"
    for _ in range(3):
        call = daemon.channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as raised:
            list(call(huge, timeout=60))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"vs. {limit})" in raised.value.details(), raised.value.details()
        assert served_by_a_fresh_client(daemon)
    wait_until(lambda: daemon.health() == SERVING, "health", 30)
    assert tracebacks(daemon) == []
    figures("grpc 100 MB", refused=3, details=raised.value.details())


# A client that opens every place the gRPC pool has (health Watch calls hold one each while they
# stay open, and send nothing while health stands still), sees the next call refused, and then stops
# as a vanished machine would: its process stopped, so no HTTP/2 frame, ping answers included, comes.
FROZEN_CLIENT = """
import os, signal, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tpserve.v1 import serving_pb2, serving_pb2_grpc
target, num_calls = sys.argv[1], int(sys.argv[2])
channel = grpc.insecure_channel(target)
health = health_pb2_grpc.HealthStub(channel)
watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=600) for _ in range(num_calls)]
for watch in watches:
    next(watch)
try:
    serving_pb2_grpc.ServingStub(channel).Tokenize(serving_pb2.TokenizeRequest(text="hi"), timeout=30)
    print("served", flush=True)
except grpc.RpcError as error:
    print(error.code().name, error.details(), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def is_stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def tokenizes(daemon) -> bool:
    try:
        return daemon.stub.Tokenize(serving_pb2.TokenizeRequest(text="hi"), timeout=30).num_tokens == 2
    except grpc.RpcError as error:
        assert (error.code(), error.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, QUEUE_FULL)
        return False


def test_a_vanished_clients_calls_are_closed_at_the_keepalive_and_free_their_places(daemon):
    command = [sys.executable, "-c", FROZEN_CLIENT, daemon.target, str(MAX_RUNNING)]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == f"RESOURCE_EXHAUSTED {QUEUE_FULL}"
        wait_until(lambda: is_stopped(client.pid), "the client to stop", 30)
        # Its calls hold every place until the server's unanswered ping closes the connection.
        waited = wait_until(lambda: tokenizes(daemon), "the frozen client's calls to close", CLOSE_WITHIN_S)
        assert is_stopped(client.pid)  # the server closed them: the client did nothing
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=30)
    assert served_by_a_fresh_client(daemon)
    assert daemon.health() == SERVING and tracebacks(daemon) == []
    figures("grpc keepalive", calls=MAX_RUNNING, freed_after_s=round(waited, 2))


def test_a_second_daemon_on_the_same_grpc_port_fails_to_start_and_the_first_serves_on(
    daemon, model_dir, tmp_path
):
    """grpc binds with SO_REUSEPORT unless told not to: a second daemon given a running one's port
    started, and the kernel handed it half of the new connections."""
    second = launch("spawn", model_dir, tmp_path / "logs", "--context", "256", "--port", str(daemon.port))
    try:
        assert second.wait_exits(timeout_s=120) == {"daemon": 2}  # a UserError, as a taken HTTP port
    finally:
        second.close()
    log = second.logs()
    assert f"cannot bind the gRPC server to 127.0.0.1:{daemon.port}" in log
    assert "Traceback" not in log
    replies = [served_by_a_fresh_client(daemon) for _ in range(8)]  # new connections, each to the first
    assert all(reply == replies[0] for reply in replies)
    assert daemon.health() == SERVING

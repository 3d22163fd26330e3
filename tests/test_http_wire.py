"""The HTTP API on the wire, below any client library: curl's view of the server-sent events, a client
that hangs up mid-reply, a full queue, a draining server and a broken engine.

The daemon is real (two ranks over gloo, a tiny random model); every wait is for a state the
daemon reports (its metrics page, its health, its exit), never for an amount of time.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess

import httpx
import openai
import pytest
from daemon import one_lane_args, running_daemon, wait_until, write_daemon_model
from test_grpc_api import GOLDEN_DIR, read_golden

LONG_CONTEXT = 4096
LONG_REPLY = 4000  # many seconds of tokens however fast the machine
CANCELLED = 'tpserve_requests_total{outcome="cancelled"}'
FINISHED_BY_LENGTH = 'tpserve_requests_total{outcome="length"}'


def long_body(stream: bool) -> dict:
    return {"prompt": "a long one", "max_tokens": LONG_REPLY, "ignore_eos": True, "stream": stream}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("wire-model"))


@pytest.fixture(scope="module")
def one_lane_daemon(model_dir, tmp_path_factory):
    """One lane, one queue place, room for long replies."""
    log_dir = tmp_path_factory.mktemp("wire-logs")
    with running_daemon("spawn", model_dir, log_dir, *one_lane_args(LONG_CONTEXT)) as served:
        yield served


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "120", *args], capture_output=True, timeout=150)


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_server_sent_events_are_data_lines_ending_in_done(one_lane_daemon, tmp_path, path):
    body = {"max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    if path == "completions":
        body["prompt"] = "hello world"
    else:
        body["messages"] = [{"role": "user", "content": "hello world"}]
    headers = tmp_path / "headers.txt"
    done = curl(
        "-N",
        *("-D", str(headers), "-H", "content-type: application/json"),
        *("-d", json.dumps(body), f"{one_lane_daemon.http_url}/{path}"),
    )
    assert done.returncode == 0, done.stderr
    assert "content-type: text/event-stream" in headers.read_text().lower()
    text = done.stdout.decode()
    # Events are "data: ..." lines, each followed by a blank line; the last one is [DONE].
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    chunks = [json.loads(event[len("data: ") :]) for event in events[:-1]]
    kind = "text_completion" if path == "completions" else "chat.completion.chunk"
    assert {chunk["object"] for chunk in chunks} == {kind}
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 1 and finishing[0]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6


def raw_request(port: int, path: str, body: dict) -> socket.socket:
    """A request written on a bare socket, so the test decides when the connection ends."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (
        f"POST /v1/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_hangs_up_frees_its_lane(one_lane_daemon, stream):
    served = one_lane_daemon
    before = served.metrics()
    sock = raw_request(served.http_port, "completions", long_body(stream))
    try:
        if stream:
            received = b""
            while received.count(b"data: ") < 3:  # the reply is flowing
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream"
                received += chunk
        else:
            wait_until(lambda: served.metrics()["tpserve_lanes_busy"] == 1, "the reply to start", 60)
    finally:
        sock.close()
    served.wait_idle(timeout_s=60)
    after = served.wait_count(CANCELLED, before.get(CANCELLED, 0) + 1)
    # Freed by the hang-up, not by the reply running out.
    assert after[CANCELLED] == before.get(CANCELLED, 0) + 1
    assert after.get(FINISHED_BY_LENGTH, 0) == before.get(FINISHED_BY_LENGTH, 0)
    follow_up = httpx.post(
        f"{served.http_url}/completions",
        json={"prompt": "next", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert follow_up.status_code == 200 and follow_up.json()["usage"]["completion_tokens"] == 4


def test_a_full_queue_is_429_with_the_grpc_wording(one_lane_daemon):
    served = one_lane_daemon
    expected = read_golden(GOLDEN_DIR / "queue_full.txt")[0]["message"]
    running = raw_request(served.http_port, "completions", long_body(True))
    waiting = None
    try:
        wait_until(lambda: served.metrics()["tpserve_lanes_busy"] == 1, "the first reply to start", 60)
        waiting = raw_request(served.http_port, "completions", long_body(True))
        wait_until(lambda: served.metrics()["tpserve_queue_depth"] == 1, "a queued request", 60)
        client = openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0)
        with client, pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model=served_model(served), prompt="hello", max_tokens=4)
        assert raised.value.status_code == 429 and raised.value.body["message"] == expected
    finally:
        running.close()
        if waiting is not None:
            waiting.close()
    served.wait_idle(timeout_s=60)


def served_model(served) -> str:
    return httpx.get(f"{served.http_url}/models", timeout=10).json()["data"][0]["id"]


def test_a_draining_server_answers_503_and_health_turns(model_dir, tmp_path):
    expected = read_golden(GOLDEN_DIR / "host_stopped.txt")[0]["message"]
    with running_daemon("spawn", model_dir, tmp_path, "--context", str(LONG_CONTEXT)) as served:
        health_url = f"http://127.0.0.1:{served.http_port}/health"
        live = raw_request(served.http_port, "completions", long_body(True))
        try:
            assert live.recv(65536)  # the stream has begun
            served.signal(0, signal.SIGTERM)
            wait_until(lambda: httpx.get(health_url, timeout=10).status_code == 503, "HTTP health 503", 30)
            assert httpx.get(health_url, timeout=10).json() == {"status": "not serving"}
            refused = httpx.post(f"{served.http_url}/completions", json={"prompt": "hello"}, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["message"] == expected
        finally:
            live.close()
        assert served.wait_exits() == {"daemon": 0}


def test_a_broken_engine_ends_a_live_stream_with_an_error_event(model_dir, tmp_path):
    with running_daemon("ranks", model_dir, tmp_path, "--context", str(LONG_CONTEXT)) as served:
        client = openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=60)
        pieces = iter(
            client.completions.create(
                model=served_model(served),
                prompt="a long one",
                max_tokens=LONG_REPLY,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        next(pieces)  # the reply is flowing
        served.signal(1, signal.SIGKILL)
        with pytest.raises(openai.APIError) as raised:
            for _ in pieces:
                pass
        assert raised.value.body["message"].startswith(
            "the engine broke during this reply; the server must be restarted"
        )
        assert served.wait_exits(["rank0"]) == {"rank0": 1}


def test_a_reply_that_fails_alone_is_a_500_and_the_server_goes_on(model_dir, tmp_path):
    poison = 200  # the follower refuses any prompt holding this token (a fault drill)
    args = ("--context", "256", "--refuse-token-on-rank", f"1,{poison}")
    with running_daemon("spawn", model_dir, tmp_path, *args) as served:
        url = f"{served.http_url}/completions"
        whole = httpx.post(
            url, json={"prompt": [5, poison, 6], "max_tokens": 4, "temperature": 0}, timeout=60
        )
        assert whole.status_code == 500
        error = whole.json()["error"]
        assert error["type"] == "server_error" and "refused" in error["message"]
        client = openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=60)
        with client, pytest.raises(openai.APIError) as raised:
            for _ in client.completions.create(model=served_model(served), prompt=[poison], stream=True):
                pass
        assert "refused" in raised.value.body["message"]
        fine = httpx.post(url, json={"prompt": [5, 6], "max_tokens": 4, "temperature": 0}, timeout=60)
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 4
        errors = 'tpserve_requests_total{outcome="error"}'
        assert served.wait_count(errors, 2)[errors] == 2


def test_a_taken_http_port_stops_the_start_naming_it(model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with running_daemon("spawn", model_dir, tmp_path, "--http-port", str(port), wait=False) as served:
            assert served.wait_exits(timeout_s=120) == {"daemon": 2}
            assert f"error: cannot bind the HTTP API to 127.0.0.1:{port}" in served.logs()
            assert served.leftovers() == []

"""The API key guards both APIs: gRPC wants `authorization: Bearer KEY` metadata and HTTP the same
header; a missing or wrong key gets UNAUTHENTICATED or 401 with one fixed message; health stays open.

The daemon is real and takes its key from the environment (TPSERVE_API_KEY), as a deployment
keeping the secret off its command line would.
"""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from daemon import (
    SERVING,
    read_reply,
    refused_start,
    running_daemon,
    write_daemon_model,
)
from test_grpc_api import run_command

from tpserve import bench, client
from tpserve.server.api_key import UNAUTHENTICATED
from tpserve.server.config import ConfigError, load_config
from tpserve.server.metrics import ServingMetrics
from tpserve.v1 import serving_pb2

KEY = "s3cret-key-for-tests"
WRONG_KEYS = [None, "", "Bearer wrong-key", f"Basic {KEY}", f"Bearer {KEY}x", KEY]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("key-model"))
    log_dir = tmp_path_factory.mktemp("key-logs")
    env = {"TPSERVE_API_KEY": KEY}
    with running_daemon("spawn", model_dir, log_dir, "--context", "256", env=env) as served:
        yield served


def metadata(authorization: str | None) -> tuple:
    return () if authorization is None else (("authorization", authorization),)


def headers(authorization: str | None) -> dict:
    return {} if authorization is None else {"authorization": authorization}


def test_grpc_needs_the_key(daemon):
    request = serving_pb2.GenerateRequest(prompt="hello", max_tokens=4)
    for authorization in WRONG_KEYS:
        reply = read_reply(daemon.stub.Generate(request, timeout=30, metadata=metadata(authorization)))
        assert (reply.code, reply.details, reply.token_ids) == (
            grpc.StatusCode.UNAUTHENTICATED,
            UNAUTHENTICATED,
            [],
        )
        with pytest.raises(grpc.RpcError) as raised:
            daemon.stub.Info(serving_pb2.InfoRequest(), timeout=30, metadata=metadata(authorization))
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    right = metadata(f"Bearer {KEY}")
    reply = read_reply(daemon.stub.Generate(request, timeout=30, metadata=right))
    assert reply.ok and len(reply.token_ids) == 4
    assert daemon.stub.Info(serving_pb2.InfoRequest(), timeout=30, metadata=right).num_lanes == 8
    assert daemon.health() == SERVING  # no key needed


def test_http_needs_the_key(daemon):
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}  # greedy: 4 tokens, no early end
    for authorization in WRONG_KEYS:
        for method, path, payload in (("POST", "completions", body), ("GET", "models", None)):
            response = httpx.request(
                method, f"{daemon.http_url}/{path}", json=payload, headers=headers(authorization), timeout=30
            )
            assert response.status_code == 401
            assert response.json()["error"]["message"] == UNAUTHENTICATED
            assert response.headers["www-authenticate"] == "Bearer"
    right = headers(f"Bearer {KEY}")
    response = httpx.post(f"{daemon.http_url}/completions", json=body, headers=right, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    health = httpx.get(f"http://127.0.0.1:{daemon.http_port}/health", timeout=30)
    assert health.status_code == 200


def test_the_openai_client_with_the_key_and_without(daemon):
    with openai.OpenAI(base_url=daemon.http_url, api_key=KEY, max_retries=0) as client:
        (model,) = client.models.list().data
        reply = client.completions.create(model=model.id, prompt="hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
    wrong = openai.OpenAI(base_url=daemon.http_url, api_key="not-the-key", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError) as raised:
        wrong.completions.create(model=model.id, prompt="hello", max_tokens=4)
    assert raised.value.status_code == 401 and raised.value.body["message"] == UNAUTHENTICATED


def test_the_key_comes_from_a_flag_over_the_environment_over_yaml(tmp_path):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("api_key: from-yaml\n")
    assert load_config(config_file, {}, environ={}).api_key == "from-yaml"
    assert load_config(config_file, {}, environ={"TPSERVE_API_KEY": "from-env"}).api_key == "from-env"
    flagged = load_config(config_file, {"api_key": "from-flag"}, environ={"TPSERVE_API_KEY": "from-env"})
    assert flagged.api_key == "from-flag"
    assert "from-flag" not in repr(flagged)  # never in a log line that prints the config
    default = load_config(None, {}, environ={})
    assert default.api_key == "" and default.http_port == 8000


def test_the_client_and_bench_commands_send_the_key(daemon, tmp_path, capsys):
    chat = ["client", "--target", daemon.target, "--prompt", "hi", "--max-tokens", "3", "--ignore-eos"]
    assert run_command(client, chat) == 1  # no key
    assert capsys.readouterr().err == f"error: UNAUTHENTICATED: {UNAUTHENTICATED}\n"
    assert run_command(client, [*chat, "--api-key", KEY]) == 0
    assert "3 completion tokens" in capsys.readouterr().err
    load = ["--concurrency", "2", "--num-requests", "2", "--prompt-tokens", "4", "--max-tokens", "3"]
    for server in (["--target", daemon.target], ["--openai-url", daemon.http_url]):
        argv = ["bench", *server, *load, "--api-key", KEY, "--no-progress", "--out", str(tmp_path)]
        assert run_command(bench, argv) == 0
        assert json.loads(capsys.readouterr().out)["num_ok"] == 2


def test_duplicate_authorization_headers_are_refused_on_both_apis_even_with_the_right_key(daemon):
    right = f"Bearer {KEY}"
    for pair in ((right, right), (right, "Bearer wrong"), ("Bearer wrong", right)):
        request = serving_pb2.GenerateRequest(prompt="hello", max_tokens=2)
        grpc_metadata = tuple(("authorization", value) for value in pair)
        reply = read_reply(daemon.stub.Generate(request, timeout=30, metadata=grpc_metadata))
        assert (reply.code, reply.details) == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        http_headers = [("authorization", value) for value in pair]
        response = httpx.post(
            f"{daemon.http_url}/completions", json={"prompt": "hi", "max_tokens": 2}, headers=http_headers
        )
        assert response.status_code == 401 and response.json()["error"]["message"] == UNAUTHENTICATED


def test_metrics_on_the_http_port_need_the_key(daemon):
    url = f"http://127.0.0.1:{daemon.http_port}/metrics"
    for authorization in WRONG_KEYS:
        assert httpx.get(url, headers=headers(authorization), timeout=30).status_code == 401
    page = httpx.get(url, headers=headers(f"Bearer {KEY}"), timeout=30)
    assert page.status_code == 200 and "tpserve_requests_total" in page.text


def test_with_metrics_need_key_the_metrics_port_needs_it_too():
    metrics = ServingMetrics()
    port = metrics.serve(0, "127.0.0.1", KEY)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        for authorization in WRONG_KEYS:
            response = httpx.get(url, headers=headers(authorization), timeout=30)
            assert response.status_code == 401 and response.json()["error"]["message"] == UNAUTHENTICATED
        twice = httpx.Headers([("authorization", f"Bearer {KEY}")] * 2)
        assert httpx.get(url, headers=twice, timeout=30).status_code == 401
        page = httpx.get(url, headers=headers(f"Bearer {KEY}"), timeout=30)
        assert page.status_code == 200 and "tpserve_requests_total" in page.text
    finally:
        metrics.stop()


@pytest.mark.parametrize(
    "key", [" leading", "trailing ", "tab\tinside", "new\nline", "bell\x07", "\u200bzero"]
)
def test_a_key_no_client_could_send_is_refused_at_start_up_without_showing_it(key):
    with pytest.raises(ConfigError) as raised:
        load_config(None, {"api_key": key}, environ={})
    assert str(raised.value).startswith("api_key: it ")
    assert key.strip() not in str(raised.value)
    with pytest.raises(ConfigError):
        load_config(None, {}, environ={"TPSERVE_API_KEY": key})


def test_the_daemon_itself_refuses_such_a_key_and_exits_2_without_showing_it(tmp_path):
    model_dir = write_daemon_model(tmp_path / "model")
    output = refused_start(model_dir, env={"TPSERVE_API_KEY": " padded-key"})
    assert "api_key: it begins or ends with whitespace" in output and "padded-key" not in output

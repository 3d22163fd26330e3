"""TLS on both APIs (ssl_certfile, ssl_keyfile), against the real two-rank daemon on loopback: a
client that trusts the signing CA is served over gRPC and HTTPS (the openai client, and `tpserve
client --ca-file`) with the same reply a plain daemon gives; a plain client is not served; files
that cannot serve TLS are refused at start-up by name, before any rank loads.
"""

from __future__ import annotations

import ssl

import grpc
import httpx
import openai
import pytest
import trustme
from daemon import (
    launch,
    read_reply,
    refused_start,
    running_daemon,
    serving,
    write_daemon_model,
)
from test_grpc_api import run_command

from tpserve import client
from tpserve.server.config import ConfigError, load_config
from tpserve.v1 import serving_pb2, serving_pb2_grpc

PROMPT = "the quick brown fox"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def authority():
    return trustme.CA()


@pytest.fixture(scope="module")
def files(authority, tmp_path_factory):
    """(certificate chain, key, CA) PEM paths for 127.0.0.1."""
    folder = tmp_path_factory.mktemp("tls")
    issued = authority.issue_cert("127.0.0.1", "localhost")
    chain, key, ca = folder / "chain.pem", folder / "key.pem", folder / "ca.pem"
    chain.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    authority.cert_pem.write_to_path(str(ca))
    return str(chain), str(key), str(ca)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("tls-model"))


@pytest.fixture(scope="module")
def daemon(files, model_dir, tmp_path_factory):
    chain, key, ca = files
    logs = tmp_path_factory.mktemp("tls-logs")
    served = launch(
        "spawn", model_dir, logs, "--context", "256", "--ssl-certfile", chain, "--ssl-keyfile", key
    )
    with open(ca, "rb") as file:
        served.ca_pem = file.read()  # its channel and http_url trust the CA from here on
    with serving(served) as started:
        yield started


@pytest.fixture(scope="module")
def plain_reply(model_dir, tmp_path_factory):
    """The greedy reply a daemon without TLS gives."""
    with running_daemon(
        "spawn", model_dir, tmp_path_factory.mktemp("plain-logs"), "--context", "256"
    ) as plain:
        return generate(plain.stub).token_ids


def generate(stub):
    request = serving_pb2.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    return read_reply(stub.Generate(request, timeout=120))


def test_grpc_over_tls_gives_the_plain_daemons_reply_and_a_plain_channel_is_not_served(daemon, plain_reply):
    reply = generate(daemon.stub)
    assert reply.ok, (reply.code, reply.details)
    assert reply.token_ids == plain_reply
    with grpc.insecure_channel(daemon.target) as plain:
        refused = generate(serving_pb2_grpc.ServingStub(plain))
    assert refused.code == grpc.StatusCode.UNAVAILABLE


def test_https_serves_the_openai_client_that_trusts_the_ca_and_plain_http_is_not_served(
    daemon, files, plain_reply
):
    _, _, ca = files
    assert daemon.http_url.startswith("https://")
    with (
        httpx.Client(verify=ssl.create_default_context(cafile=ca)) as http,
        openai.OpenAI(
            base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=60, http_client=http
        ) as api,
    ):
        reply = api.completions.create(
            model=None,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    assert reply.choices[0].model_extra["token_ids"] == plain_reply
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{daemon.http_port}/v1/models", timeout=10).raise_for_status()
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA refuses the server
        httpx.get(f"{daemon.http_url}/models", timeout=10)


def test_the_client_command_trusts_a_ca_file(daemon, files, capsys):
    _, _, ca = files
    argv = ["client", "--target", daemon.target, "--prompt", "hi", "--max-tokens", "3", "--ignore-eos"]
    assert run_command(client, [*argv, "--ca-file", ca]) == 0
    assert "3 completion tokens" in capsys.readouterr().err


def test_files_that_cannot_serve_tls_are_refused_by_name(files, authority, tmp_path):
    chain, key, _ = files
    other_key = tmp_path / "other.pem"
    authority.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    cases = [
        ({"ssl_certfile": chain}, "ssl_certfile and ssl_keyfile go together"),
        ({"ssl_keyfile": key}, "ssl_certfile and ssl_keyfile go together"),
        ({"ssl_certfile": str(tmp_path / "none.pem"), "ssl_keyfile": key}, "cannot read"),
        ({"ssl_certfile": chain, "ssl_keyfile": str(other_key)}, "do not load together"),
    ]
    for flags, wording in cases:
        with pytest.raises(ConfigError, match=wording):
            load_config(None, flags, environ={})
    assert load_config(None, {"ssl_certfile": chain, "ssl_keyfile": key}, environ={}).ssl_keyfile == key


def test_the_daemon_refuses_a_key_that_is_not_its_certificates_and_exits_2(
    files, authority, model_dir, tmp_path
):
    chain, _, _ = files
    other_key = tmp_path / "other.pem"
    authority.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    output = refused_start(model_dir, "--ssl-certfile", chain, "--ssl-keyfile", str(other_key))
    assert "do not load together" in output and "Traceback" not in output

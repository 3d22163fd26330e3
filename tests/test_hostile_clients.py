"""What a hostile or careless client can send the real daemon (two ranks, gloo, loopback), and what
must hold: huge prompts refused before any tokenizing while live streams go on and memory comes
back, malformed bodies and messages refused as 400 / INVALID_ARGUMENT with a golden error and no
traceback in the log, slow clients cut off at the configured timeouts, the key's edge cases.
Each test prints a `figures:` line; run with -s to see them.
"""

from __future__ import annotations

import codecs
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from daemon import SERVING, BackgroundReply, running_daemon, write_daemon_model

from tpserve.v1 import serving_pb2

CONTEXT = 512
LONGEST_TOKEN_BYTES = 13  # the daemon model's "<|endoftext|>" (tests/test_prompt_size.py)
MAX_PROMPT_BYTES = CONTEXT * LONGEST_TOKEN_BYTES
BIG_PROMPT_CHARS = (4 << 20) - 100  # just under the HTTP body limit
GOLDEN_HTTP_DIR = Path(__file__).parent / "golden" / "errors" / "http"


def figures(name: str, **values) -> None:
    print(f"figures: {name}: {json.dumps(values, sort_keys=True)}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("hostile-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("hostile-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", str(CONTEXT), "--lanes", "4") as served:
        yield served


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def tracebacks(daemon) -> list[str]:
    return [line for line in daemon.logs().splitlines() if "Traceback" in line or " ERROR " in line]


def post(daemon, path: str, content: bytes, **kwargs) -> httpx.Response:
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{daemon.http_url}/{path}", content=content, headers=headers, timeout=120, **kwargs)


# ---- limits before work ----


def test_the_largest_prompts_are_refused_before_tokenizing_while_a_stream_goes_on(daemon):
    rank0 = daemon.ranks()[0].pid
    expected = (
        f"prompt is {BIG_PROMPT_CHARS} bytes long; no prompt over {MAX_PROMPT_BYTES} bytes can fit "
        f"the context of {CONTEXT} tokens"
    )
    bodies = [json.dumps({"prompt": digit * BIG_PROMPT_CHARS, "max_tokens": 4}).encode() for digit in "1234"]
    with ThreadPoolExecutor(8) as pool:  # a first round warms the threads and their heaps: the baseline
        list(pool.map(lambda body: post(daemon, "completions", body), bodies * 2))
    before = rss_bytes(rank0)
    live = BackgroundReply(
        daemon.stub, serving_pb2.GenerateRequest(prompt="go", max_tokens=200, ignore_eos=True)
    )
    live.wait_tokens(1)
    started = time.monotonic()

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda body: post(daemon, "completions", body), bodies * 3))
        responses += list(pool.map(lambda body: post(daemon, "completions", body), bodies * 3))
        text = "7" * BIG_PROMPT_CHARS
        tokenize = pool.submit(daemon.stub.Tokenize, serving_pb2.TokenizeRequest(text=text), timeout=60)
        with pytest.raises(grpc.RpcError) as raised:
            tokenize.result()
    reply = live.join(timeout_s=120)
    assert reply.ok and len(reply.token_ids) == 200
    assert [(r.status_code, r.json()["error"]["message"]) for r in responses] == [(400, expected)] * 24
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"text is {BIG_PROMPT_CHARS} bytes long")
    after = rss_bytes(rank0)
    assert after <= before * 1.10, (before, after)
    assert daemon.health() == SERVING
    figures(
        "big prompts",
        refused=24,
        seconds=round(time.monotonic() - started, 2),
        rss_before=before,
        rss_after=after,
    )


# ---- malformed bytes ----

RAW_GOLDEN = sorted((Path(__file__).parent / "golden" / "errors" / "raw").glob("*.txt"))
_REPEAT = re.compile(rb"\{\{(\d+)\*(.*?)\}\}")


def read_raw_golden(path: Path) -> tuple[dict[str, str], bytes]:
    """The header and the body's bytes (tests/golden/errors/raw/README.md)."""
    header_text, _, body_text = path.read_text().partition("\n---\n")
    header = dict(line.split(": ", 1) for line in header_text.splitlines())
    body = codecs.escape_decode(body_text.rstrip("\n").encode())[0]
    return header, _REPEAT.sub(lambda match: match.group(2) * int(match.group(1)), body)


def send_raw_grpc(daemon, rpc: str, body: bytes) -> grpc.RpcError:
    identity = {"request_serializer": None, "response_deserializer": None}
    method = f"/tpserve.v1.Serving/{rpc}"
    with pytest.raises(grpc.RpcError) as raised:
        if rpc == "Generate":
            list(daemon.channel.unary_stream(method, **identity)(body, timeout=30))
        else:
            daemon.channel.unary_unary(method, **identity)(body, timeout=30)
    return raised.value


@pytest.mark.parametrize("path", RAW_GOLDEN, ids=lambda path: path.stem)
def test_malformed_bytes_get_their_golden_refusal_and_no_traceback(path, daemon):
    header, body = read_raw_golden(path)
    if header["api"] == "http":
        response = post(daemon, header.get("path", "completions"), body)
        assert response.status_code == int(header["status"])
        error = response.json()["error"]
        assert error["message"] == header["message"]
        assert error["type"] == "invalid_request_error"
    else:
        error = send_raw_grpc(daemon, header.get("rpc", "Generate"), body)
        assert (error.code().name, error.details()) == (header["code"], header["message"])
    assert daemon.health() == SERVING
    assert tracebacks(daemon) == []

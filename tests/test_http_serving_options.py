"""How the HTTP API is served, against the real two-rank daemon on loopback: several served model
names (--served-model-name), a chat template file in place of the checkpoint's (--chat-template),
CORS origins (--cors-origins), and vLLM's skip_special_tokens: false; each with the APIs in rank 0's
process and in the front process (tpserve/server/front_process.py), which must serve them the same.
"""

from __future__ import annotations

import httpx
import pytest
from daemon import running_daemon, write_daemon_model
from test_http_api import post

from tpserve.v1 import serving_pb2

# Renders a conversation with no special tokens at all, unlike the checkpoint's template.
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
ORIGIN = "http://dashboard.example"


@pytest.fixture(scope="module", params=["false", "true"], ids=["in-process", "front-process"])
def daemon(tmp_path_factory, request):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("options-model"))
    template = tmp_path_factory.mktemp("options-template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ("--context", "256", "--lanes", "2", "--served-model-name", "tiny,tiny-alias")
    args += ("--chat-template", str(template), "--cors-origins", ORIGIN, "--front-process", request.param)
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("options-logs"), *args) as served:
        assert (served.front() is not None) == (request.param == "true")
        yield served


def complete(daemon, **fields) -> httpx.Response:
    return post(daemon, "completions", {"prompt": "hello", "max_tokens": 2, "ignore_eos": True, **fields})


def test_every_served_name_is_listed_and_answers_and_another_is_404(daemon):
    listed = httpx.get(f"{daemon.http_url}/models", timeout=30).json()
    assert [card["id"] for card in listed["data"]] == ["tiny", "tiny-alias"]
    assert httpx.get(f"{daemon.http_url}/models/tiny-alias", timeout=30).json()["id"] == "tiny-alias"
    reply = complete(daemon, model="tiny-alias")
    assert reply.status_code == 200 and reply.json()["model"] == "tiny"  # replies name the first
    unknown = complete(daemon, model="gpt-4")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    # gRPC names no model: Info reports the first name.
    assert daemon.stub.Info(serving_pb2.InfoRequest(), timeout=30).model_name == "tiny"


def test_the_chat_template_file_replaces_the_checkpoints(daemon):
    messages = [{"role": "user", "content": "hi"}]
    rendered = post(daemon, "../tokenize", {"messages": messages}).json()["tokens"]
    expected = post(daemon, "../tokenize", {"prompt": "[user] hi\n[assistant] "}).json()["tokens"]
    assert rendered == expected
    chat = post(daemon, "chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(expected)


def test_cors_answers_the_configured_origin_only(daemon):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = httpx.options(
        f"{daemon.http_url}/completions", headers={"Origin": ORIGIN, **preflight}, timeout=30
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{daemon.http_url}/completions",
        headers={"Origin": "http://elsewhere.example", **preflight},
        timeout=30,
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = complete(daemon, model=None)
    assert "access-control-allow-origin" not in simple.headers  # no Origin: no CORS headers
    from_origin = post(daemon, "completions", {"prompt": "hi", "max_tokens": 1}, headers={"Origin": ORIGIN})
    assert from_origin.headers["access-control-allow-origin"] == ORIGIN


def test_skip_special_tokens_false_keeps_them_in_the_text(daemon):
    (marker,) = post(daemon, "../tokenize", {"prompt": "<|im_start|>"}).json()["tokens"]
    forced = {"logit_bias": {str(marker): 100}, "return_token_ids": True}
    skipped = complete(daemon, **forced).json()["choices"][0]
    kept = complete(daemon, skip_special_tokens=False, **forced).json()["choices"][0]
    assert skipped["token_ids"] == kept["token_ids"] == [marker, marker]
    assert skipped["text"] == "" and kept["text"] == "<|im_start|><|im_start|>"
    stream = httpx.post(
        f"{daemon.http_url}/completions",
        json={"prompt": "hello", "max_tokens": 2, "stream": True, "skip_special_tokens": False, **forced},
        timeout=60,
    )
    assert "<|im_start|>" in stream.text
    bad = complete(daemon, skip_special_tokens="no")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "skip_special_tokens"

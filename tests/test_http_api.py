"""The OpenAI-compatible HTTP API as its users call it: the real `openai` client against the real
daemon (two ranks over gloo, a tiny random model), on loopback.

Every reply is compared with what gRPC gives for the same request, token for token; every refusal
that gRPC's golden files freeze is sent over HTTP too and must read the same, with the HTTP status
an OpenAI client expects.
"""

from __future__ import annotations

import json
import math
import threading

import grpc
import httpx
import openai
import pytest
from daemon import SERVING, read_reply, running_daemon, write_daemon_model
from google.protobuf import text_format
from test_grpc_api import GOLDEN_DIR, read_golden, run_command

from tpserve import bench
from tpserve.openai_body import openai_body
from tpserve.v1 import serving_pb2

CONTEXT = 64  # the golden files' context
REPLY_CONTEXT = 512
NUM_STREAMS = 64
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "UNIMPLEMENTED": 501}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("http-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    """Four lanes and room for chats (the byte-level tokenizer makes a short chat 30 tokens)."""
    log_dir = tmp_path_factory.mktemp("http-logs")
    with running_daemon(
        "spawn", model_dir, log_dir, "--context", str(REPLY_CONTEXT), "--lanes", "4"
    ) as served:
        yield served


@pytest.fixture(scope="module")
def golden_daemon(model_dir, tmp_path_factory):
    """The golden files' `default` server: context 64, two lanes, no --vision."""
    log_dir = tmp_path_factory.mktemp("http-golden-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", str(CONTEXT), "--lanes", "2") as served:
        yield served


def openai_client(daemon) -> openai.OpenAI:
    # No retries: a 429 or 503 is what a test wants to see, not something to hide.
    return openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(daemon):
    with openai_client(daemon) as client:
        yield client


@pytest.fixture(scope="module")
def golden_client(golden_daemon):
    with openai_client(golden_daemon) as client:
        yield client


@pytest.fixture(scope="module")
def model_name(model_dir):
    return model_dir.name


def grpc_reply(daemon, **fields):
    return read_reply(daemon.stub.Generate(serving_pb2.GenerateRequest(**fields), timeout=60))


def chat_messages(*texts: str) -> list[dict]:
    roles = ["system", "user", "assistant", "user"]
    return [{"role": roles[i], "content": text} for i, text in enumerate(texts)]


def as_proto_messages(messages: list[dict]) -> list[serving_pb2.ChatMessage]:
    return [serving_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def token_ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---- replies ----


def test_chat_whole_equals_the_grpc_reply(daemon, client, model_name):
    messages = chat_messages("be brief", "the quick brown fox")
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    completion = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=16,
        extra_body={"top_k": 40, "min_p": 0.01, "return_token_ids": True},
        user="a-test",
        **sampling,
    )
    expected = grpc_reply(
        daemon, messages=as_proto_messages(messages), max_tokens=16, top_k=40, min_p=0.01, **sampling
    )
    assert expected.ok
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert token_ids_of(choice) == expected.token_ids
    assert choice.finish_reason == {1: "stop", 2: "length"}[expected.finish_reason]
    assert completion.object == "chat.completion" and completion.model == model_name
    usage, grpc_usage = completion.usage, expected.last.usage
    assert usage.prompt_tokens == grpc_usage.prompt_tokens
    assert usage.completion_tokens == grpc_usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_streamed_arrives_in_pieces_that_add_up_to_the_grpc_reply(daemon, client, model_name):
    messages = chat_messages("be brief", "hello there")
    stream = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=20,  # the newer name of max_tokens
        temperature=0,  # gRPC's unset (the HTTP API's unset is vLLM's 1.0)
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(stream)
    expected = grpc_reply(daemon, messages=as_proto_messages(messages), max_tokens=20, ignore_eos=True)
    pieces = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert pieces[0].delta.role == "assistant"
    text_pieces = [piece.delta.content for piece in pieces if piece.delta.content]
    assert len(text_pieces) > 1  # streamed, not sent in one piece
    assert "".join(text_pieces) == expected.text
    assert [t for piece in pieces for t in piece.model_extra.get("token_ids", [])] == expected.token_ids
    assert pieces[-1].finish_reason == "length" and len(expected.token_ids) == 20
    # include_usage: one last chunk with no choices and the usage.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == expected.last.usage.prompt_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert len({chunk.id for chunk in chunks}) == 1


def test_completion_from_token_ids_equals_the_grpc_reply(daemon, client, model_name):
    prompt = [40, 41, 42, 43, 44]
    completion = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    expected = grpc_reply(daemon, prompt_token_ids=prompt, max_tokens=12)
    (choice,) = completion.choices
    assert completion.object == "text_completion"
    assert choice.text == expected.text and token_ids_of(choice) == expected.token_ids
    assert completion.usage.prompt_tokens == len(prompt)
    # A text prompt, streamed, gives the gRPC reply to the same text.
    streamed = client.completions.create(
        model=model_name, prompt="hello world", max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in streamed)
    assert text == grpc_reply(daemon, prompt="hello world", max_tokens=12).text


def test_a_stop_string_ends_the_reply_before_it(daemon, client, model_name):
    free = client.completions.create(
        model=model_name, prompt="stop here", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    # A character from the reply's middle: the reply with it as a stop string ends before it.
    stop = next(ch for ch in text[4:] if ch.isascii() and ch.isprintable())
    stopped = client.completions.create(
        model=model_name, prompt="stop here", max_tokens=24, temperature=0, stop=[stop]
    )
    (choice,) = stopped.choices
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)] and stop not in choice.text
    assert choice.text == grpc_reply(daemon, prompt="stop here", max_tokens=24, stop=[stop]).text
    # stop may also be one string; a stream stops at the same place.
    stopped_streamed = client.completions.create(
        model=model_name, prompt="stop here", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stopped_streamed) == choice.text


def test_a_seed_reproduces_a_sampled_reply(client, model_name):
    def sampled(seed: int) -> str:
        completion = client.chat.completions.create(
            model=model_name,
            messages=chat_messages("be brief", "tell me a story"),
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return completion.choices[0].message.content

    first = sampled(7)
    assert sampled(7) == first
    assert sampled(8) != first


def test_logprobs_are_the_grpc_ones_and_the_greedy_token_is_the_likeliest(daemon, client, model_name):
    messages = chat_messages("be brief", "the sea")
    completion = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    expected = grpc_reply(
        daemon, messages=as_proto_messages(messages), max_tokens=10, ignore_eos=True, logprobs=3
    )
    (choice,) = completion.choices
    entries = choice.logprobs.content
    assert [entry.model_extra["token_id"] for entry in entries] == token_ids_of(choice) == expected.token_ids
    assert len(entries) == 10
    assert len(expected.logprobs) == 10
    for entry, grpc_entry in zip(entries, expected.logprobs, strict=True):
        assert entry.logprob == pytest.approx(grpc_entry.logprob, rel=1e-6)
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert tops == pytest.approx([top.logprob for top in grpc_entry.top], rel=1e-6)
        # Greedy: the token sampled is the likeliest one.
        assert entry.top_logprobs[0].model_extra["token_id"] == entry.model_extra["token_id"]
        assert entry.logprob == tops[0]
        assert sum(math.exp(top) for top in tops) <= 1 + 1e-9
    # The completions API's shape, streamed: parallel lists, one entry per token.
    streamed = client.completions.create(
        model=model_name,
        prompt="the sea",
        max_tokens=8,
        temperature=0,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [chunk.choices[0] for chunk in streamed if chunk.choices and chunk.choices[0].logprobs]
    tokens = [token for piece in pieces for token in piece.logprobs.tokens]
    token_logprobs = [value for piece in pieces for value in piece.logprobs.token_logprobs]
    assert len(tokens) == len(token_logprobs) == 8
    assert (
        "".join(piece.text for piece in pieces)
        == grpc_reply(daemon, prompt="the sea", max_tokens=8, ignore_eos=True).text
    )
    assert all(len(top) <= 2 for piece in pieces for top in piece.logprobs.top_logprobs)


def test_usage_counts_the_prompt_cache(client, model_name):
    messages = chat_messages("you are a helpful assistant who answers briefly", "what is the sea?")
    client.chat.completions.create(model=model_name, messages=messages, max_tokens=4)
    again = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4)
    details = again.usage.prompt_tokens_details
    assert 0 < details.cached_tokens < again.usage.prompt_tokens


def test_models_and_health(daemon, client, model_name):
    (model,) = client.models.list().data
    assert model.id == model_name and model.model_extra["max_model_len"] == REPLY_CONTEXT
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    health = httpx.get(f"http://127.0.0.1:{daemon.http_port}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "serving"}


def test_64_concurrent_streams_all_complete_and_equal_their_solo_runs(daemon, client, model_name):
    def request(index: int) -> dict:
        return {
            "model": model_name,
            "prompt": f"prompt number {index}",
            "max_tokens": 8 + index % 5,
            "temperature": 0.8,
            "seed": index,
            "logprobs": 1,
            "extra_body": {"ignore_eos": True},
        }

    def reply(choices) -> tuple[str, list[float]]:
        """The text and each token's log probability (the same bits whatever ran beside it)."""
        return "".join(c.text for c in choices), [
            v for c in choices if c.logprobs for v in c.logprobs.token_logprobs
        ]

    solo = [reply(client.completions.create(**request(i)).choices) for i in range(NUM_STREAMS)]
    together: list[tuple | None] = [None] * NUM_STREAMS
    failures: list[BaseException] = []
    barrier = threading.Barrier(NUM_STREAMS)

    def stream(index: int) -> None:
        try:
            barrier.wait(timeout=60)
            pieces = client.completions.create(stream=True, **request(index))
            together[index] = reply([chunk.choices[0] for chunk in pieces])
        except BaseException as error:  # reported below, with the others
            failures.append(error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert failures == []
    assert together == solo
    assert all(len(logprobs) == 8 + i % 5 for i, (_, logprobs) in enumerate(solo))
    daemon.wait_idle()


# ---- refusals ----


GOLDEN_DEFAULT = [
    path
    for path in sorted(GOLDEN_DIR.glob("*.txt"))
    if read_golden(path)[0].get("server", "default") == "default"
    and read_golden(path)[0].get("rpc", "Generate") == "Generate"
]


def post(daemon, path: str, body, **kwargs) -> httpx.Response:
    """POSTs a dict as JSON (NaN stays NaN, as Python reads it), or bytes or an iterator of them as
    they are (an iterator goes chunked, with no length declared)."""
    content = json.dumps(body) if isinstance(body, dict) else body
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{daemon.http_url}/{path}", content=content, headers=headers, timeout=60, **kwargs)


@pytest.mark.parametrize("path", GOLDEN_DEFAULT, ids=lambda path: path.stem)
def test_golden_error_reads_the_same_over_http(path, golden_daemon):
    header, request_text = read_golden(path)
    http = openai_body(text_format.Parse(request_text, serving_pb2.GenerateRequest()))
    if http is None:
        pytest.skip("an OpenAI body cannot carry this request's fields")
    response = post(golden_daemon, *http)
    assert response.status_code == HTTP_STATUS[header["code"]]
    error = response.json()["error"]
    assert error["message"] == header["message"]
    assert error["code"] == header["code"].lower()


def test_a_bad_field_is_refused_naming_it(golden_client, model_name):
    messages = chat_messages("hi")
    cases = [
        ({"max_tokens": 65}, "max_tokens", "max_tokens (65) exceeds the context of 64 tokens"),
        ({"temperature": -0.5}, "temperature", "temperature must be from 0 to 100 (got -0.5)"),
        ({"extra_body": {"top_k": "many"}}, "top_k", "top_k must be an integer (got 'many')"),
        ({"n": 0}, "n", "n must be at least 1 (got 0)"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "logprobs", "logprobs must be from 0 to 20 (got 21)"),
        ({"extra_body": {"priority": 3}}, "priority", "priority is not supported by this server"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be from -2 to 2 (got 2.5)"),
        (
            {"extra_body": {"temprature": 1}},
            "temprature",
            "temprature is not a field of /v1/chat/completions this server knows",
        ),
    ]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            golden_client.chat.completions.create(model=model_name, messages=messages, **fields)
        assert raised.value.status_code == 400
        assert (raised.value.body["param"], raised.value.body["message"]) == (param, message)


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=chat_messages("hi"), max_tokens=4)
    assert raised.value.body["code"] == "model_not_found" and "gpt-4o" in raised.value.body["message"]


def test_a_10_mb_body_is_refused_with_413(daemon):
    body = json.dumps({"prompt": "x" * (10 << 20), "max_tokens": 4}).encode()
    response = post(daemon, "completions", body)
    assert response.status_code == 413
    assert response.json()["error"]["message"] == "the request body is larger than 4194304 bytes"
    # Without a declared length (chunked), the body is cut off at the same size.
    response = post(daemon, "completions", iter([body[i : i + 65536] for i in range(0, len(body), 65536)]))
    assert response.status_code == 413
    assert daemon.health() == SERVING


def test_a_body_that_is_not_json_is_400(daemon):
    response = post(daemon, "completions", b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert post(daemon, "completions", b"[1, 2]").json()["error"]["message"] == (
        "the request body must be a JSON object"
    )
    unknown = httpx.get(f"{daemon.http_url}/nothing-here", timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "no route /v1/nothing-here"


def test_grpc_and_http_refuse_alike(daemon, client, model_name):
    """The same bad request gets the same words on both APIs (a spot check beyond the goldens)."""
    with pytest.raises(grpc.RpcError) as grpc_error:
        for _ in daemon.stub.Generate(serving_pb2.GenerateRequest(prompt="hello", top_p=0), timeout=10):
            pass
    with pytest.raises(openai.BadRequestError) as http_error:
        client.completions.create(model=model_name, prompt="hello", top_p=0)
    assert http_error.value.body["message"] == grpc_error.value.details()
    assert http_error.value.body["param"] == "top_p"


# ---- tpserve bench --openai-url ----


@pytest.mark.parametrize("load", [["--concurrency", "4"], ["--rate", "100"]], ids=["closed", "open"])
def test_bench_times_the_http_api_like_grpc(daemon, tmp_path, capsys, load):
    common = [*load, "--num-requests", "8", "--prompt-tokens", "6", "--max-tokens", "5", "--no-progress"]
    summaries = {}
    for api, server in (("openai", ["--openai-url", daemon.http_url]), ("grpc", ["--target", daemon.target])):
        out = tmp_path / api
        code = run_command(bench, ["bench", *server, *common, "--out", str(out)])
        summaries[api] = json.loads(capsys.readouterr().out)
        assert code == 0
        assert summaries[api] == json.loads((out / "summary.json").read_text())
        assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert len((out / "requests.jsonl").read_text().splitlines()) == 8
    http, grpc_summary = summaries["openai"], summaries["grpc"]
    assert http["api"] == "openai" and http["model"] == grpc_summary["model"]
    for summary in (http, grpc_summary):
        assert summary["num_ok"] == 8 and summary["errors"] == {}
        # ignore_eos: every reply is exactly --max-tokens long, whichever API counted it.
        assert summary["output_tokens_per_s"] == pytest.approx(5 * summary["requests_per_s"])
        assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p90"] <= summary["ttft_s"]["p99"]
        assert 0 < summary["itl_s"]["p50"] <= summary["itl_s"]["p99"]


def test_bench_reports_a_refused_load_as_errors(daemon, tmp_path, capsys):
    # Prompts longer than the context: every request is refused (HTTP 400), none times anything.
    argv = ["bench", "--openai-url", daemon.http_url, "--concurrency", "2", "--num-requests", "3"]
    argv += ["--prompt-tokens", str(REPLY_CONTEXT + 1), "--no-progress", "--out", str(tmp_path)]
    assert run_command(bench, argv) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_ok"] == 0 and summary["errors"] == {"HTTP 400": 3}

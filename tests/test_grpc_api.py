"""The gRPC API end to end: a real server on a loopback port, a real LaneHost on its own thread over
the fake backend, a tiny byte-level tokenizer, and a real gRPC client.

The fake's tokens depend on the whole history of their lane, so a reply that equals the fake's solo
run of the same token ids shows the servicer tokenized, submitted and relayed it faithfully.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from fake_backend import FakeBackend
from fake_replies import run_all
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tiny_llava import IMAGE_TOKEN, write_tiny_llava
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tpserve import bench, client
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.model_config import load_model_config
from tpserve.server.grpc_server import GrpcServer
from tpserve.server.lane_host import LaneHost
from tpserve.server.media_fetch import MediaFetcher
from tpserve.server.metrics import ServingMetrics
from tpserve.server.requests import GenerationRequest
from tpserve.server.servicer import ServingInfo
from tpserve.server.submitter import Submitter
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.vision_input import VisionInput
from tpserve.v1 import serving_pb2, serving_pb2_grpc

GOLDEN_DIR = Path(__file__).parent / "golden" / "errors"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; the fake's EOS is 0 too
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT_SIZE = 64
# The golden `llava` server's image limits (tests/golden/errors/README.md).
LLAVA_LIMITS = {"max_images": 2, "max_image_bytes": 1024, "max_image_pixels": 64 * 64}
WAIT_S = 10.0


def tiny_tokenizer() -> Tokenizer:
    """Byte-level, no merges: 3 specials + 256 bytes, the same 259 ids every time."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate(SPECIALS + alphabet)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    return Tokenizer(backend, eos_ids={0}, chat_template=CHATML)


class SlowBackend(FakeBackend):
    """The fake, with decode rounds that take time and a gate a test can close to hold them."""

    def __init__(self, *, decode_delay_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.decode_delay_s = decode_delay_s
        self.gate = threading.Event()
        self.gate.set()

    def decode(self, items, prompts=()):
        self.gate.wait(WAIT_S)  # bounded, so a test that forgets to open it fails instead of hanging
        time.sleep(self.decode_delay_s)
        return super().decode(items, prompts)


def broken_backend() -> FakeBackend:
    """A fake whose first decode round breaks the engine."""
    backend = FakeBackend(num_lanes=1, context_size=CONTEXT_SIZE)
    backend.break_after_decodes = 0
    return backend


@dataclass
class Served:
    backend: FakeBackend
    host: LaneHost
    server: GrpcServer
    tokenizer: Tokenizer
    stub: serving_pb2_grpc.ServingStub
    channel: grpc.Channel

    def health(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S).status


@contextmanager
def serving(
    backend: FakeBackend,
    *,
    vision: bool = False,
    queue_size: int = 8,
    metrics_port: int | None = None,
    tokenizer: Tokenizer | None = None,
    vision_input: VisionInput | None = None,
    media_fetcher: MediaFetcher | None = None,
    **limits,
):
    """`limits`: further ServingInfo fields (the image limits). media_fetcher: the server's fetcher
    of Media urls (None: every url refused)."""
    tokenizer = tokenizer or tiny_tokenizer()
    host = LaneHost(backend, detokenize=tokenizer.decode, eos_ids=tokenizer.eos_ids, queue_size=queue_size)
    host.start()
    info = ServingInfo(
        model_name="tiny-fake",
        tp_size=1,
        num_lanes=backend.num_lanes,
        context_size=backend.context_size,
        room=backend.room,
        vision=vision,
        **limits,
    )
    submitter = Submitter(host, tokenizer, info, ServingMetrics(host.stats, host.block_stats), vision_input)
    server = GrpcServer(
        host,
        tokenizer,
        info,
        queue_size=queue_size,
        metrics_port=metrics_port,
        health_poll_s=0.05,
        submitter=submitter,
        media_fetcher=media_fetcher,
    )
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Served(backend, host, server, tokenizer, serving_pb2_grpc.ServingStub(channel), channel)
    finally:
        channel.close()
        server.stop(grace_s=1.0)
        host.stop(grace_s=1.0)
    # Every lane a client cancelled, timed out or finished went back to the backend.
    assert backend.misuse == []
    if not host.broken:
        backend.assert_clean()


@pytest.fixture(scope="module")
def llava_served(tmp_path_factory):
    """The golden files' `llava` server: --vision on a tiny LLaVA's tokenizer and vision tower (the
    fake stands in for the text model), with the small image limits of LLAVA_LIMITS. Built only
    for the tests that ask for it."""
    model_dir = write_tiny_llava(tmp_path_factory.mktemp("llava"))
    config = load_model_config(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    reader = VisionInput.from_model_dir(model_dir, config, IMAGE_TOKEN, torch.float32)
    backend = FakeBackend(num_lanes=1, context_size=CONTEXT_SIZE)
    with serving(backend, vision=True, tokenizer=tokenizer, vision_input=reader, **LLAVA_LIMITS) as served:
        yield served


@pytest.fixture(scope="module")
def served():
    with serving(SlowBackend(num_lanes=2, context_size=CONTEXT_SIZE), metrics_port=0) as served:
        yield served


def wait_until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def collect(responses) -> tuple[list[int], str, serving_pb2.GenerateResponse, list]:
    responses = list(responses)
    token_ids = [token for response in responses for token in response.token_ids]
    text = "".join(response.text for response in responses)
    return token_ids, text, responses[-1], responses


# ---- Generate ----


def solo_reply(served: Served, request: GenerationRequest):
    """The oracle: `request` alone on a fresh fake of the same shape, stepped by hand (no gRPC).

    (FakeBackend.solo_reply detokenizes with the fake's own vocabulary, which the tiny tokenizer's
    prompts fall outside of.)
    """
    backend = FakeBackend(num_lanes=served.backend.num_lanes, context_size=served.backend.context_size)
    host = LaneHost(backend, detokenize=served.tokenizer.decode, eos_ids=served.tokenizer.eos_ids)
    (reply,) = run_all(host, [host.submit(request)])
    return reply


@pytest.mark.parametrize(
    "make_input",
    [
        lambda tok: ({"prompt": "hello world"}, tok.encode("hello world")),
        lambda tok: ({"prompt_token_ids": [40, 41, 42, 43]}, [40, 41, 42, 43]),
        lambda tok: (
            {"messages": [serving_pb2.ChatMessage(role="user", content="hi there")]},
            tok.encode_chat([{"role": "user", "content": "hi there"}]),
        ),
    ],
    ids=["prompt", "token_ids", "chat"],
)
@pytest.mark.parametrize("seed", [None, 7])
def test_generate_streams_the_reply_the_backend_gives_alone(served, make_input, seed):
    fields, prompt_ids = make_input(served.tokenizer)
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed)
    request = serving_pb2.GenerateRequest(max_tokens=20, **fields)
    if seed is not None:
        request.temperature, request.seed = 0.8, seed
    token_ids, text, last, responses = collect(served.stub.Generate(request, timeout=WAIT_S))

    solo = solo_reply(served, GenerationRequest(tuple(prompt_ids), 20, sampling))
    assert responses[0].prefilled and not responses[0].token_ids
    assert tuple(token_ids) == solo.token_ids
    assert text == served.tokenizer.decode(token_ids)
    expected_reason = {"stop": serving_pb2.FINISH_REASON_STOP, "length": serving_pb2.FINISH_REASON_LENGTH}
    assert last.finish_reason == expected_reason[solo.reason]
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == solo.completion_tokens
    assert last.usage.HasField("time_to_first_token_s")
    assert last.usage.total_s >= last.usage.time_to_first_token_s > 0


def test_ignore_eos_runs_to_max_tokens_and_unset_max_tokens_takes_the_default(served):
    prompt_ids = [7] * 10
    request = serving_pb2.GenerateRequest(prompt_token_ids=prompt_ids, ignore_eos=True)
    token_ids, _, last, _ = collect(served.stub.Generate(request, timeout=WAIT_S))
    # The default is what the context leaves after the prompt (as vLLM's).
    assert len(token_ids) == CONTEXT_SIZE - len(prompt_ids)
    assert last.finish_reason == serving_pb2.FINISH_REASON_LENGTH


def test_a_stop_string_ends_the_reply_before_it(served):
    base = serving_pb2.GenerateRequest(prompt="stop here", max_tokens=30, ignore_eos=True)
    _, full_text, _, _ = collect(served.stub.Generate(base, timeout=WAIT_S))
    stop = full_text[10:12]
    base.stop.append(stop)
    _, text, last, _ = collect(served.stub.Generate(base, timeout=WAIT_S))
    assert text == full_text[: full_text.index(stop)]
    assert last.finish_reason == serving_pb2.FINISH_REASON_STOP


SLOW_DECODE_S = 0.25  # 50 tokens take 12 s at this pace, so only a cancel frees a lane in 2 s
PROMPT_FREE_S = 30.0  # a hang guard: waits end as soon as the lane is free


def test_cancelling_mid_stream_frees_the_lane_promptly(served):
    served.backend.decode_delay_s = SLOW_DECODE_S
    try:
        request = serving_pb2.GenerateRequest(prompt="a long one", max_tokens=50, ignore_eos=True)
        call = served.stub.Generate(request, timeout=30.0)
        for _, response in zip(range(3), call):
            assert not response.finish_reason
        assert served.host.stats().lanes_busy == 1
        call.cancel()
        wait_until(lambda: served.host.stats().lanes_busy == 0, "the cancelled stream's lane", PROMPT_FREE_S)
    finally:
        served.backend.decode_delay_s = 0.0
    assert served.backend.lanes == {}


def test_a_passed_deadline_frees_the_lane_promptly(served):
    served.backend.decode_delay_s = SLOW_DECODE_S
    try:
        request = serving_pb2.GenerateRequest(prompt="slow", max_tokens=50, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as raised:
            collect(served.stub.Generate(request, timeout=0.5))
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: served.host.stats().lanes_busy == 0, "the timed-out stream's lane", PROMPT_FREE_S)
    finally:
        served.backend.decode_delay_s = 0.0


# ---- Tokenize, Info, health, reflection ----


def test_tokenize_text_and_chat(served):
    response = served.stub.Tokenize(serving_pb2.TokenizeRequest(text="hello wörld"), timeout=WAIT_S)
    assert list(response.token_ids) == served.tokenizer.encode("hello wörld")
    assert response.num_tokens == len("hello wörld".encode())  # one id a byte here
    messages = [
        serving_pb2.ChatMessage(role="system", content="be brief"),
        serving_pb2.ChatMessage(role="user"),
    ]
    messages[1].parts.add(text="hi ")
    messages[1].parts.add(text="there")
    response = served.stub.Tokenize(serving_pb2.TokenizeRequest(messages=messages), timeout=WAIT_S)
    expected = served.tokenizer.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    )
    assert list(response.token_ids) == expected and response.num_tokens == len(expected)


def test_info_describes_the_served_model(served):
    info = served.stub.Info(serving_pb2.InfoRequest(), timeout=WAIT_S)
    assert (info.model_name, info.tp_size, info.num_lanes) == ("tiny-fake", 1, 2)
    assert (info.context_size, info.room, info.vocab_size) == (CONTEXT_SIZE, served.backend.room, 259)
    assert info.version and not info.vision and info.default_max_tokens == 0  # the context left


def test_health_is_serving_and_reflection_lists_the_services(served):
    assert served.health() == health_pb2.HealthCheckResponse.SERVING
    assert served.health("tpserve.v1.Serving") == health_pb2.HealthCheckResponse.SERVING
    database = ProtoReflectionDescriptorDatabase(served.channel)
    assert {"tpserve.v1.Serving", "grpc.health.v1.Health"} <= set(database.get_services())
    generate = database.FindFileContainingSymbol("tpserve.v1.Serving")
    assert generate.name == "tpserve/v1/serving.proto"


def test_a_broken_engine_fails_live_streams_with_unavailable_and_turns_health_not_serving():
    with serving(broken_backend()) as served:
        assert served.health() == health_pb2.HealthCheckResponse.SERVING
        request = serving_pb2.GenerateRequest(prompt="boom", max_tokens=5)
        with pytest.raises(grpc.RpcError) as raised:
            collect(served.stub.Generate(request, timeout=WAIT_S))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert raised.value.details().startswith(
            "the engine broke during this reply; the server must be restarted (engine broken: "
        )
        wait_until(
            lambda: served.health() == health_pb2.HealthCheckResponse.NOT_SERVING,
            "health to turn NOT_SERVING",
        )


def test_metrics_count_requests_tokens_and_read_the_lane_host(served):
    request = serving_pb2.GenerateRequest(prompt="count me", max_tokens=6, ignore_eos=True)
    collect(served.stub.Generate(request, timeout=WAIT_S))
    with pytest.raises(grpc.RpcError):
        collect(served.stub.Generate(serving_pb2.GenerateRequest(prompt=""), timeout=WAIT_S))
    url = f"http://127.0.0.1:{served.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT_S) as page:
        text = page.read().decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values['tpserve_requests_total{outcome="length"}'] >= 1
    assert values['tpserve_requests_total{outcome="invalid_argument"}'] >= 1
    assert values["tpserve_completion_tokens_total"] >= 6
    assert values["tpserve_time_to_first_token_seconds_count"] >= 1
    assert values["tpserve_lanes"] == 2 and values["tpserve_lanes_busy"] == 0
    assert values["tpserve_queue_depth"] == 0 and values["tpserve_room_tokens"] == served.backend.room


# ---- golden errors ----


def read_golden(path: Path) -> tuple[dict[str, str], str]:
    header_text, _, request_text = path.read_text().partition("\n---\n")
    header = dict(line.split(": ", 1) for line in header_text.splitlines())
    return header, request_text


@contextmanager
def server_in_state(state: str, default_served: Served, request=None):
    """A server in the golden file's `server` state (see tests/golden/errors/README.md)."""
    if state == "default":
        yield default_served
    elif state == "vision":
        with serving(FakeBackend(num_lanes=1, context_size=CONTEXT_SIZE), vision=True) as served:
            yield served
    elif state == "llava":
        yield request.getfixturevalue("llava_served")
    elif state == "broken":
        with serving(broken_backend()) as served:
            with pytest.raises(grpc.RpcError):
                collect(served.stub.Generate(serving_pb2.GenerateRequest(prompt="break"), timeout=WAIT_S))
            assert served.host.broken
            yield served
    elif state == "host_stopped":
        with serving(FakeBackend(num_lanes=1, context_size=CONTEXT_SIZE)) as served:
            served.host.stop(grace_s=0.0)
            yield served
    elif state == "full":
        backend = SlowBackend(num_lanes=1, context_size=CONTEXT_SIZE)
        backend.gate.clear()  # the one lane's first decode round waits
        with serving(backend, queue_size=1) as served:
            request = serving_pb2.GenerateRequest(prompt="hold", max_tokens=8)
            running = served.stub.Generate(request, timeout=WAIT_S)
            assert next(running).prefilled  # in its lane, stuck before its first decode round
            waiting = served.stub.Generate(request, timeout=WAIT_S)
            wait_until(lambda: served.host.stats().queued == 1, "the second request to queue")
            try:
                yield served
            finally:
                running.cancel()
                waiting.cancel()
                backend.gate.set()
    else:
        raise ValueError(f"unknown server state {state!r}")


@pytest.mark.parametrize("path", sorted(GOLDEN_DIR.glob("*.txt")), ids=lambda path: path.stem)
def test_golden_error(served, path, request):
    header, request_text = read_golden(path)
    rpc = header.get("rpc", "Generate")
    request_type = {"Generate": serving_pb2.GenerateRequest, "Tokenize": serving_pb2.TokenizeRequest}[rpc]
    message = text_format.Parse(request_text, request_type())
    with (
        server_in_state(header.get("server", "default"), served, request) as target,
        pytest.raises(grpc.RpcError) as raised,
    ):
        if rpc == "Generate":
            collect(target.stub.Generate(message, timeout=WAIT_S))
        else:
            target.stub.Tokenize(message, timeout=WAIT_S)
    assert (raised.value.code().name, raised.value.details()) == (header["code"], header["message"])


# ---- the client and bench commands ----


def run_command(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_client_streams_the_reply_text_to_stdout(served, capsys):
    target = f"127.0.0.1:{served.server.port}"
    code = run_command(
        client, ["client", "--target", target, "--prompt", "hi", "--max-tokens", "9", "--ignore-eos"]
    )
    out, err = capsys.readouterr()
    request = serving_pb2.GenerateRequest(prompt="hi", max_tokens=9, ignore_eos=True)
    _, text, _, _ = collect(served.stub.Generate(request, timeout=WAIT_S))
    assert code == 0
    assert out == text + "\n"
    assert err.startswith("[length: 2 prompt tokens (0 cached), 9 completion tokens")
    code = run_command(client, ["client", "--target", target, "--prompt", "hi", "--max-tokens", "0"])
    assert code == 1
    assert capsys.readouterr().err == "error: INVALID_ARGUMENT: max_tokens must be at least 1 (got 0)\n"


@pytest.mark.parametrize("load", [["--concurrency", "3"], ["--rate", "200"]], ids=["closed", "open"])
def test_bench_reports_throughput_and_latency(served, tmp_path, capsys, load):
    target = f"127.0.0.1:{served.server.port}"
    argv = ["bench", "--target", target, *load, "--num-requests", "6", "--prompt-tokens", "5"]
    code = run_command(bench, [*argv, "--max-tokens", "4", "--out", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_ok"] == 6 and summary["errors"] == {}
    assert summary["output_tokens_per_s"] == pytest.approx(4 * summary["requests_per_s"])
    assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p90"] <= summary["ttft_s"]["p99"]
    assert summary["tpot_s"]["p50"] > 0
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 6
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The systems bench.peer compares, each started as its own server process on loopback, and the
clients that time one request of each: tpserve's daemon (gRPC, or the OpenAI HTTP API), llama.cpp's
llama-server (its `/completion` stream) and vLLM's CPU build (the OpenAI `/v1/completions` stream,
the client tpserve's HTTP API gets too). Every client's `generate(index, num_tokens, load)` sends
prompt `index` (`load`: its temperature and length) and returns its Timing."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tpserve.prepare import find_default_gguf
from tpserve.ranks.local_ranks import free_port
from tpserve.v1 import serving_pb2, serving_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300.0
VLLM_START_TIMEOUT_S = 900.0  # a compiled start takes minutes, more on a busy machine
PEER_CACHE = Path.home() / ".cache/tpserve-peer"
VLLM_MODEL_NAME = "peer-model"
TOPICS = ("rivers", "bridges", "libraries", "volcanoes", "gardens", "trains", "comets", "bees")


@dataclass
class Timing:
    sent: float
    first: float = 0.0
    end: float = 0.0
    num_tokens: int = 0
    reply: list = field(default_factory=list)  # token ids (tpserve) or text pieces (llama-server)


FILLER = (
    "The lane host admits waiting requests, prefills their prompts and runs decode rounds over every "
    "live lane while the follower replays each message on its own shard of the weights. "
)


@dataclass(frozen=True)
class Load:
    """How each request of a burst is made: its sampling temperature (0: greedy; a seed per request
    otherwise) and the copies of FILLER its prompt carries."""

    temperature: float = 0.0
    fillers: int = 0


def prompt(index: int, fillers: int) -> str:
    # The index comes first, so no two prompts share a prefix a prompt cache could serve.
    return f"Request {index}. {FILLER * fillers}Here is fact {index} about {TOPICS[index % len(TOPICS)]}:"


class Server:
    """A server process of one system, its log in a temporary file, ended with SIGTERM (then KILL)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ready,
        generate,
        cwd: Path = REPO,
        env: dict | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.name, self.generate = name, generate
        self.http_generate = generate  # tpserve's: its OpenAI HTTP client beside gRPC
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (kept open while the server runs)
            prefix=f"peer-{name.replace(' ', '_')}-", suffix=".log", delete=False
        )
        self.process = subprocess.Popen(
            argv, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        deadline = time.monotonic() + start_timeout_s
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name} did not start: {shlex.join(argv)}; log {self.log.name}")
            time.sleep(0.5)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def start_tpserve(name: str, flags: list[str], repo: Path = REPO, api: str = "grpc") -> Server:
    """tpserve from `repo` (another checkout, with its own .venv, to compare versions in one run),
    called over gRPC or over the OpenAI HTTP client (`api`: "grpc" or "http")."""
    port, http_port = free_port(), free_port()
    python = sys.executable if repo == REPO else str(repo / ".venv/bin/python")
    argv = [python, "-m", "tpserve.cli", "serve", "--config", str(repo / "configs/default.yaml")]
    argv += ["--port", str(port), "--metrics-port", "0", "--http-port", str(http_port), *flags]
    # python -m finds the package of its cwd first: the server runs from `repo`
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = serving_pb2_grpc.ServingStub(channel)

    def ready() -> bool:
        try:
            stub.Info(serving_pb2.InfoRequest(), timeout=1)
            return True
        except grpc.RpcError:
            return False

    def generate(index: int, num_tokens: int, load: Load) -> Timing:
        timing = Timing(time.perf_counter())
        request = serving_pb2.GenerateRequest(
            prompt=prompt(index, load.fillers),
            max_tokens=num_tokens,
            ignore_eos=True,
            temperature=load.temperature,
        )
        if load.temperature > 0:
            request.seed = index
        for response in stub.Generate(request, timeout=600):
            if response.token_ids and not timing.first:
                timing.first = time.perf_counter()
            timing.num_tokens += len(response.token_ids)
            timing.reply += response.token_ids
        timing.end = time.perf_counter()
        return timing

    http_generate = completions_generate(http_port, None)  # the same client as vLLM's
    server = Server(name, argv, ready, http_generate if api == "http" else generate, cwd=repo)
    server.http_generate = http_generate
    return server


def streamed_chunks(port: int, path: str, body: dict, timeout_s: float) -> Iterator[dict]:
    """POST `body` to an OpenAI streaming route on 127.0.0.1:`port`; yields each server-sent event's
    JSON chunk (up to `[DONE]`). A status other than 200 raises with the start of its body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"{path} answered {reply.status}: {reply.read()[:300]!r}")
        for line in reply:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                yield json.loads(line[6:])
    finally:
        connection.close()


def completions_generate(port: int, model: str | None):
    """The OpenAI `/v1/completions` streaming client every server gets (tpserve's HTTP API, vLLM):
    its `generate(index, num_tokens, load)` times one request; the reply is its text pieces.
    `model`: the served model's name where the server wants one."""

    def generate(index: int, num_tokens: int, load: Load) -> Timing:
        timing = Timing(time.perf_counter())
        body = {"prompt": prompt(index, load.fillers), "max_tokens": num_tokens, "ignore_eos": True}
        body |= {"model": model} if model else {}
        body |= {"stream": True, "temperature": load.temperature, "stream_options": {"include_usage": True}}
        if load.temperature > 0:
            body["seed"] = index
        for chunk in streamed_chunks(port, "/v1/completions", body, timeout_s=600):
            text = "".join(choice.get("text", "") for choice in chunk.get("choices", ()))
            if text and not timing.first:
                timing.first = time.perf_counter()
            if text:
                timing.reply.append(text)
            if chunk.get("usage"):
                timing.num_tokens = chunk["usage"]["completion_tokens"]
        timing.end = time.perf_counter()
        return timing

    return generate


def health_ready(port: int):
    """Whether a peer on `port` answers its /health with 200 yet (llama-server's and vLLM's)."""

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False

    return ready


def start_llama(binary: str, gguf: Path, num_slots: int, context: int) -> Server:
    """llama-server with `num_slots` slots of `context` tokens each (a prompt and its reply)."""
    port = free_port()
    argv = [binary, "-m", str(gguf), "-np", str(num_slots), "-t", "2", "-c", str(num_slots * context)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-webui"]

    def generate(index: int, tokens: int, load: Load) -> Timing:
        timing = Timing(time.perf_counter())
        body = {
            "prompt": prompt(index, load.fillers),
            "n_predict": tokens,
            "ignore_eos": True,
            "stream": True,
        }
        body |= {"temperature": load.temperature, "cache_prompt": False}
        if load.temperature > 0:
            body["seed"] = index
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        connection.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        for line in reply:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("content") and not timing.first:
                timing.first = time.perf_counter()
            timing.reply.append(chunk.get("content", ""))
            if chunk.get("stop"):
                timing.num_tokens = chunk.get("tokens_predicted", 0)
        connection.close()
        timing.end = time.perf_counter()
        return timing

    return Server("llama-server", argv, health_ready(port), generate)


def vllm_model_dir(given: str | None) -> Path:
    """A float32 Hugging Face directory of the default model (vLLM cannot read tpserve's int4)."""
    if given:
        return Path(given)
    out = PEER_CACHE / "default-model-f32"
    if not (out / "model.safetensors").is_file():
        from tpserve.gguf_import import import_gguf  # the gguf package, only for this peer

        import_gguf(find_default_gguf(), out, progress=False, force=True, dequantize=True)
    return out


def start_vllm(python: str, model_dir: Path, dtype: str, num_seqs: int, context: int) -> Server:
    """vLLM's OpenAI server on the CPU, TP=1 (the default model's 9 heads do not split in two),
    `context` tokens per sequence."""
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--served-model-name", VLLM_MODEL_NAME, "--dtype", dtype, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--max-num-seqs", str(num_seqs), "--max-model-len", str(context)]
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # both cores, as llama-server's -t 2
        "VLLM_HOST_IP": "127.0.0.1",
    }

    generate = completions_generate(port, VLLM_MODEL_NAME)
    ready = health_ready(port)
    return Server(f"vLLM {dtype}", argv, ready, generate, env=env, start_timeout_s=VLLM_START_TIMEOUT_S)


def find_llama_server(given: str | None) -> str | None:
    candidates = [given, os.environ.get("TPSERVE_LLAMA_SERVER")]
    candidates += sorted(str(p) for p in (Path.home() / ".cache/tpserve-peer").glob("**/bin/llama-server"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def find_vllm(given: str | None) -> str | None:
    """The Python of vLLM's own virtual environment."""
    candidates = [given, os.environ.get("TPSERVE_VLLM_PYTHON"), str(PEER_CACHE / "vllm-venv/bin/python")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)

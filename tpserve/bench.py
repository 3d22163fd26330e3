"""`tpserve bench`: load a running server and report throughput and latency.

Closed loop (--concurrency N: N clients, each sending its next request when the last one ends) or
open loop (--rate R: Poisson arrivals at R requests/s, whatever the server's pace). Reports requests/s,
output tokens/s, time to first token (TTFT) and time per output token (TPOT, after the first) at
p50/p90/p99, as JSON on stdout and in DIR/summary.json, with each request in DIR/requests.jsonl and a
plot in DIR/latency.png.

Synthetic prompts are random token ids (--prompt-tokens long) with ignore_eos, so every reply is
exactly --max-tokens long; --jsonl sends the prompts of a file instead (one JSON object a line with
"prompt", "messages" or "prompt_token_ids", and optionally "max_tokens"), cycled to --num-requests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from tpserve.ranks.errors import UserError
from tpserve.v1 import serving_pb2, serving_pb2_grpc

PERCENTILES = (50, 90, 99)
FAILED_REASONS = (serving_pb2.FINISH_REASON_CANCELLED, serving_pb2.FINISH_REASON_ERROR)


@dataclass(frozen=True)
class RequestResult:
    sent_s: float  # since the run began
    ttft_s: float | None  # None when no token came
    total_s: float
    num_output_tokens: int
    error: str | None  # the gRPC status code's name, or a finish reason other than stop/length

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.num_output_tokens - 1)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="load a running server; report throughput and latency")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--target", required=True, help="the server's host:port")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="clients sending back to back")
    load.add_argument("--rate", type=float, help="Poisson arrivals per second")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--jsonl", type=Path, help="prompts to send instead of random token ids")
    parser.add_argument("--seed", type=int, default=0, help="for the random prompts and arrivals")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, in seconds")
    parser.add_argument("--out", type=Path, required=True, help="directory for the summary and plot")
    parser.set_defaults(run=run)


def synthetic_requests(
    num_requests: int, prompt_tokens: int, max_tokens: int, vocab_size: int, seed: int
) -> list[serving_pb2.GenerateRequest]:
    rng = random.Random(seed)
    return [
        serving_pb2.GenerateRequest(
            prompt_token_ids=[rng.randrange(vocab_size) for _ in range(prompt_tokens)],
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        for _ in range(num_requests)
    ]


def jsonl_requests(path: Path, num_requests: int, max_tokens: int) -> list[serving_pb2.GenerateRequest]:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            request = serving_pb2.GenerateRequest(max_tokens=entry.get("max_tokens", max_tokens))
            if "prompt" in entry:
                request.prompt = entry["prompt"]
            for message in entry.get("messages", []):
                request.messages.add(role=message["role"], content=message["content"])
            request.prompt_token_ids.extend(entry.get("prompt_token_ids", []))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
            raise UserError(f"{path}:{number}: not a prompt entry: {error}") from error
        prompts.append(request)
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return [prompts[index % len(prompts)] for index in range(num_requests)]


def send_one(stub, request, run_start: float, timeout_s: float) -> RequestResult:
    sent = time.monotonic()
    first: float | None = None
    num_tokens = 0
    error = None
    try:
        for response in stub.Generate(request, timeout=timeout_s):
            if response.token_ids and first is None:
                first = time.monotonic()
            num_tokens += len(response.token_ids)
            if response.finish_reason in FAILED_REASONS:
                error = serving_pb2.FinishReason.Name(response.finish_reason)
    except grpc.RpcError as rpc_error:
        error = rpc_error.code().name
    end = time.monotonic()
    return RequestResult(
        sent_s=sent - run_start,
        ttft_s=None if first is None else first - sent,
        total_s=end - sent,
        num_output_tokens=num_tokens,
        error=error,
    )


def run_closed_loop(stub, requests, concurrency: int, timeout_s: float) -> tuple[list[RequestResult], float]:
    results: list[RequestResult | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))
    lock = threading.Lock()
    start = time.monotonic()

    def client() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            results[index] = send_one(stub, requests[index], start, timeout_s)

    with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        for done in [pool.submit(client) for _ in range(concurrency)]:
            done.result()
    return [result for result in results if result is not None], time.monotonic() - start


def run_open_loop(
    stub, requests, rate: float, seed: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed + 1)
    start = time.monotonic()
    # Enough threads that an arrival never waits for a free one: that would close the loop.
    with futures.ThreadPoolExecutor(max_workers=min(len(requests), 512)) as pool:
        pending = []
        arrival = start
        for request in requests:
            arrival += rng.expovariate(rate)
            time.sleep(max(0.0, arrival - time.monotonic()))
            pending.append(pool.submit(send_one, stub, request, start, timeout_s))
        results = [done.result() for done in pending]
    return results, time.monotonic() - start


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(point) for p, point in zip(PERCENTILES, points)}


def summarize(results: list[RequestResult], duration_s: float, settings: dict) -> dict:
    ok = [result for result in results if result.error is None]
    errors: dict[str, int] = {}
    for result in results:
        if result.error is not None:
            errors[result.error] = errors.get(result.error, 0) + 1
    num_output_tokens = sum(result.num_output_tokens for result in ok)
    return {
        **settings,
        "num_ok": len(ok),
        "errors": errors,
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": num_output_tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
    }


def plot(results: list[RequestResult], summary: dict, path: Path) -> None:
    # matplotlib is imported here, not at the top: it costs about a second, and every other
    # tpserve command (the daemon included) imports this module to register `bench`.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [result for result in results if result.error is None and result.ttft_s is not None]
    figure = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(figure)
    ttft_axes, tpot_axes = figure.subplots(1, 2)
    ttft_axes.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=8)
    ttft_axes.set(xlabel="sent at (s)", ylabel="time to first token (s)", title="TTFT per request")
    tpots = [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]
    tpot_axes.hist(tpots, bins=30)
    tpot_axes.set(xlabel="time per output token (ms)", ylabel="requests", title="TPOT")
    figure.suptitle(
        f"{summary['requests_per_s']:.2f} requests/s, {summary['output_tokens_per_s']:.1f} output tokens/s"
    )
    figure.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    if args.num_requests < 1:
        raise UserError("--num-requests must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise UserError("--concurrency must be at least 1")
    if args.rate is not None and not args.rate > 0:
        raise UserError("--rate must be above 0")
    with grpc.insecure_channel(args.target) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        try:
            info = stub.Info(serving_pb2.InfoRequest(), timeout=30.0)
        except grpc.RpcError as error:
            raise UserError(f"cannot reach {args.target}: {error.code().name}: {error.details()}") from error
        if args.jsonl is not None:
            requests = jsonl_requests(args.jsonl, args.num_requests, args.max_tokens)
        else:
            requests = synthetic_requests(
                args.num_requests, args.prompt_tokens, args.max_tokens, info.vocab_size, args.seed
            )
        if args.concurrency is not None:
            results, duration_s = run_closed_loop(stub, requests, args.concurrency, args.timeout)
        else:
            results, duration_s = run_open_loop(stub, requests, args.rate, args.seed, args.timeout)
    settings = {
        "target": args.target,
        "model": info.model_name,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "num_requests": args.num_requests,
        "prompt_tokens": None if args.jsonl else args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "jsonl": None if args.jsonl is None else str(args.jsonl),
    }
    summary = summarize(results, duration_s, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (args.out / "requests.jsonl").open("w") as lines:
        for result in results:
            lines.write(json.dumps({**asdict(result), "tpot_s": result.tpot_s}) + "\n")
    plot(results, summary, args.out / "latency.png")
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if summary["num_ok"] == len(results) else 1

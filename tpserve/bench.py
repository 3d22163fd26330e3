"""`tpserve bench`: load a running server and report throughput and latency.

The server is tpserve over gRPC (--target HOST:PORT) or any OpenAI-compatible HTTP API (--openai-url
http://HOST:PORT/v1: tpserve's own, llama.cpp's server, vLLM), so one load can time several servers.
Closed loop (--concurrency N: N clients, each sending its next request when the last one ends) or
open loop (--rate R: Poisson arrivals at R requests/s, whatever the server's pace). Reports requests/s,
output tokens/s, time to first token (TTFT), time per output token (TPOT, after the first) and
inter-token latency (ITL: the gap before each later message or event that carries tokens) at
p50/p90/p99, as JSON on stdout and in DIR/summary.json, with each request in DIR/requests.jsonl and a
plot in DIR/latency.png.

Synthetic prompts are random token ids (--prompt-tokens long) with ignore_eos, so every reply is
exactly --max-tokens long (over HTTP they go to /v1/completions as token ids, so the server's
vocabulary size must be known: tpserve lists it, elsewhere give --vocab-size); --jsonl sends the prompts of a file instead (one JSON object a line with
"prompt", "messages" or "prompt_token_ids", and optionally "max_tokens"), cycled to --num-requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tpserve.bench_senders import GrpcSender, OpenAISender, RequestResult
from tpserve.ranks.errors import UserError
from tpserve.server.api_key import API_KEY_ENV
from tpserve.v1 import serving_pb2

PERCENTILES = (50, 90, 99)
Send = Callable[[serving_pb2.GenerateRequest, float], RequestResult]


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="load a running server; report throughput and latency")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--target", help="a tpserve gRPC server's host:port")
    server.add_argument(
        "--openai-url", help="an OpenAI-compatible API's base URL, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument("--model", help="with --openai-url: the model to ask for (default: the first listed)")
    parser.add_argument("--vocab-size", type=int, help="for random prompts, where the server does not say it")
    parser.add_argument("--api-key", default=None, help=f"sent as Bearer KEY (default: ${API_KEY_ENV})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
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
            temperature=0.0,  # greedy on either API and any server (vLLM's unset is 1.0)
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
            request = serving_pb2.GenerateRequest(
                max_tokens=entry.get("max_tokens", max_tokens), temperature=0.0
            )
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


def run_closed_loop(
    send: Send, requests, concurrency: int, on_done: Callable[[], object]
) -> tuple[list[RequestResult], float]:
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
            results[index] = send(requests[index], start)
            on_done()

    with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        for done in [pool.submit(client) for _ in range(concurrency)]:
            done.result()
    return [result for result in results if result is not None], time.monotonic() - start


def run_open_loop(
    send: Send, requests, rate: float, seed: int, on_done: Callable[[], object]
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
            pending.append(pool.submit(send, request, start))
            pending[-1].add_done_callback(lambda _: on_done())
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
        "itl_s": percentiles([gap for r in ok for gap in r.itl_s]),
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
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    if args.openai_url is not None:
        sender = OpenAISender(
            args.openai_url,
            api_key=api_key,
            model=args.model,
            timeout_s=args.timeout,
            max_connections=args.concurrency or min(args.num_requests, 512),
        )
    else:
        sender = GrpcSender(args.target, api_key=api_key, timeout_s=args.timeout)
    try:
        model_name, served_vocab_size = sender.describe()
        if args.jsonl is not None:
            requests = jsonl_requests(args.jsonl, args.num_requests, args.max_tokens)
        else:
            vocab_size = args.vocab_size or served_vocab_size
            if not vocab_size:
                raise UserError(f"{sender.target} does not say its vocabulary size: give --vocab-size")
            requests = synthetic_requests(
                args.num_requests, args.prompt_tokens, args.max_tokens, vocab_size, args.seed
            )
        with tqdm(total=len(requests), desc="bench", unit="req", disable=args.no_progress) as bar:
            if args.concurrency is not None:
                results, duration_s = run_closed_loop(sender.send, requests, args.concurrency, bar.update)
            else:
                results, duration_s = run_open_loop(sender.send, requests, args.rate, args.seed, bar.update)
    finally:
        sender.close()
    settings = {
        "target": sender.target,
        "api": "openai" if args.openai_url is not None else "grpc",
        "model": model_name,
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

"""A live stream's largest gap between tokens while a burst of the largest prompts arrives, with
the APIs in rank 0's process and in a front process of their own (tpserve/server/front_process.py).

Each mode starts the real daemon (`tpserve serve`, two ranks, the shipped default model unless
--model), streams one greedy reply over gRPC, and once it runs steadily posts `--prompts` prompts of
digits (the slowest text to tokenize) over HTTP at once, each as long as the limits let through
to the tokenizer (prompt_size.py: what the context could ever hold); each is refused in the end
(over the context). Reported per mode: the stream's median gap before the burst, its largest gap
from the burst's start to its last answer, their ratio, and the burst's time; then the in-process
largest gap over the front process's. Both modes run in one run, one after the other.

    python -m bench.front_gap [--prompts 4 --context 8192] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench.common import default_model_dir, finish, median, print_table  # noqa: E402
from tpserve.server.prompt_size import max_prompt_bytes  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402
from tpserve.v1 import serving_pb2, serving_pb2_grpc  # noqa: E402

START_TIMEOUT_S = 300.0
STEADY_S = 2.0  # the stream's pace before the burst
AFTER_TOKENS = 3  # messages of the stream after the burst: its largest gap has ended
BURST_TIMEOUT_S = 600.0
EXIT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Daemon:
    def __init__(
        self, model_dir: str, context: int, front: bool, log_path: Path, extra_args: Sequence[str] = ()
    ):
        self.port, self.http_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TPSERVE_API_KEY")}
        env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = [
            *(sys.executable, "-m", "tpserve.cli", "serve", "--model", model_dir),
            *("--port", str(self.port), "--http-port", str(self.http_port), "--metrics-port", "0"),
            *("--context", str(context), "--threads-per-rank", "1", "--device", "cpu"),
            *("--front-process", "true" if front else "false"),
            *extra_args,
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def wait_serving(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.process.returncode} before serving")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the daemon did not serve within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> int:
        self.channel.close()
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=EXIT_TIMEOUT_S)
        finally:
            self._log.close()


def post_big_prompt(http_port: int, model: str, prompt_bytes: int, seed: int) -> int:
    digits = "".join(str((seed * 7 + i * 13) % 10) for i in range(1000))
    body = json.dumps(
        {"model": model, "prompt": (digits * (prompt_bytes // 1000 + 1))[:prompt_bytes], "max_tokens": 1}
    )
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=BURST_TIMEOUT_S) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        if error.code != 400:  # 400: over the context, as expected once tokenized
            print(f"HTTP {error.code}: {error.read()[:300]!r}")
        return error.code


def run_mode(
    model_dir: str, context: int, num_prompts: int, prompt_bytes: int, front: bool, log: Path
) -> dict:
    daemon = Daemon(model_dir, context, front, log)
    try:
        daemon.wait_serving()
        stub = serving_pb2_grpc.ServingStub(daemon.channel)
        request = serving_pb2.GenerateRequest(
            prompt="Tell me a long story.", max_tokens=context // 2, ignore_eos=True, temperature=0
        )
        call = stub.Generate(request, timeout=BURST_TIMEOUT_S)
        times: list[float] = []  # when each of the stream's messages arrived

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled once the burst is over
                for _ in call:
                    times.append(time.monotonic())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while len(times) < 2:
            time.sleep(0.05)
        time.sleep(STEADY_S)
        statuses: list[int] = []
        began = time.monotonic()
        posters = [
            threading.Thread(
                target=lambda i=i: statuses.append(
                    post_big_prompt(daemon.http_port, Path(model_dir).name, prompt_bytes, i)
                )
            )
            for i in range(num_prompts)
        ]
        for poster in posters:
            poster.start()
        for poster in posters:
            poster.join(BURST_TIMEOUT_S)
        ended = time.monotonic()
        resumed = len(times) + AFTER_TOKENS  # the stream's pace again, after the burst
        deadline = ended + BURST_TIMEOUT_S
        while len(times) < resumed and time.monotonic() < deadline:
            time.sleep(0.05)
        call.cancel()
        reader.join(10)
    finally:
        code = daemon.stop()
    pairs = list(zip(times, times[1:]))
    before = [b - a for a, b in pairs if b < began]
    during = [b - a for a, b in pairs if b >= began and a <= ended]  # every gap the burst overlaps
    return {
        "front_process": front,
        "median_gap_before_s": median(before),
        "largest_gap_during_s": max(during) if during else float("inf"),
        "gap_ratio": (max(during) if during else float("inf")) / median(before),
        "burst_s": ended - began,
        "statuses": sorted(statuses),
        "exit_code": code,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")
    parser.add_argument("--prompts", type=int, default=4, help="big prompts posted at once")
    parser.add_argument("--context", type=int, default=8192, help="the daemon's context (sizes the prompts)")
    parser.add_argument("--prompt-bytes", type=int, default=0, help="0: the largest the limits tokenize")
    parser.add_argument("--logs", default="/tmp", help="where the daemons' logs go")
    args = parser.parse_args(argv)
    model_dir = args.model or default_model_dir()
    limit = max_prompt_bytes(args.context, Tokenizer.from_model_dir(model_dir).longest_token_bytes)
    prompt_bytes = args.prompt_bytes or limit
    runs = [
        run_mode(
            model_dir,
            args.context,
            args.prompts,
            prompt_bytes,
            front,
            Path(args.logs) / f"front_gap_{front}.log",
        )
        for front in (False, True)
    ]
    here, front = runs
    report = {
        "model": model_dir,
        "context": args.context,
        "prompts": args.prompts,
        "prompt_bytes": prompt_bytes,
        "runs": runs,
        "largest_gap_in_process_over_front": here["largest_gap_during_s"] / front["largest_gap_during_s"],
    }
    print_table(
        f"one live stream while {args.prompts} prompts of {prompt_bytes} bytes of digits arrive",
        ("APIs", "median gap before s", "largest gap during s", "ratio", "burst s", "statuses"),
        [
            (
                "front process" if run["front_process"] else "rank 0's process",
                run["median_gap_before_s"],
                run["largest_gap_during_s"],
                run["gap_ratio"],
                run["burst_s"],
                " ".join(map(str, run["statuses"])),
            )
            for run in runs
        ],
    )
    print(f"largest gap, in-process over front process: {report['largest_gap_in_process_over_front']:.2f}x")
    return finish(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

"""What the benchmarks share: the model, engine settings, prompts, stream watching, timing, reports.

Every benchmark measures the things it compares side by side in one run and reports their ratio,
because this machine is shared and noisy: absolute times drift from run to run, ratios much less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Named here for the benchmarks; they live apart so the GPU check can import them without this
# module's default-model preparation (which needs the `gguf` package).
from bench.prompts import FILLER, chat_prompt, text_prompt  # noqa: F401
from bench.tables import print_table  # noqa: F401
from tpserve.kernels.machine import machine_facts
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.prepare import prepare
from tpserve.ranks.settings import EngineSettings
from tpserve.server.lane_host import LaneHost, Stream
from tpserve.server.requests import Finished, GenerationRequest, TokenDelta

GREEDY = SamplingParams()
THREADS_PER_RANK = 1  # two ranks on a two-core machine: one core each
STREAM_TIMEOUT_S = 600.0  # a stream that sends nothing this long means the engine hung
SUBMIT_SWITCH_INTERVAL_S = 1.0


def default_model_dir() -> str:
    """The prepared default model (imported from its GGUF on first use)."""
    return str(prepare(progress=False))


def bench_settings(model_dir: str, **overrides) -> EngineSettings:
    """Engine settings for a benchmark: two ranks on the CPU, one thread each, unless overridden
    (these benchmarks measure the CPU pair, also on a GPU host; bench/gpu_check.py is the GPU's)."""
    values = {"model_dir": model_dir, "device": "cpu", "threads_per_rank": THREADS_PER_RANK} | overrides
    return EngineSettings(**values)


def submit_together(host: LaneHost, requests: Sequence[GenerationRequest]) -> list[Stream]:
    """Submit every request as if they arrived in the same instant.

    Without care the scheduler thread wakes at the first submit and may admit that one alone before
    the rest are queued. Submitting only appends to the host's queue and never blocks, so keeping
    the interpreter on this thread for the whole loop (a long GIL switch interval) queues them all
    before the scheduler looks.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SUBMIT_SWITCH_INTERVAL_S)
    try:
        return [host.submit(request) for request in requests]
    finally:
        sys.setswitchinterval(previous)


@dataclass
class StreamRecord:
    """What one stream sent: its tokens, when the lane host put each, and how it ended."""

    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() as the host put it
    finished: Finished | None = None


def watch_streams(streams: Sequence[Stream], timeout_s: float = STREAM_TIMEOUT_S) -> list[StreamRecord]:
    """Read every stream to its end, timing each token when the lane host puts it: a listener on
    the scheduling thread drains its stream (no reader thread per stream, whose wait for the GIL
    would show as a gap the engine never made)."""
    records = [StreamRecord() for _ in streams]
    num_open, lock, done = [len(streams)], threading.Lock(), threading.Event()

    def listener(stream: Stream, record: StreamRecord, order: threading.Lock):
        def drain() -> None:
            with order:  # listen() may call it once on this thread while the host calls it too
                now = time.perf_counter()
                for event in stream.next_events(0):
                    if isinstance(event, TokenDelta):
                        record.token_ids.extend(event.token_ids)
                        record.token_times.extend([now] * len(event.token_ids))
                    elif isinstance(event, Finished) and record.finished is None:
                        record.finished = event
                        with lock:
                            num_open[0] -= 1
                            if num_open[0] == 0:
                                done.set()

        return drain

    for stream, record in zip(streams, records):
        stream.listen(listener(stream, record, threading.Lock()))
    if streams and not done.wait(timeout_s):
        unfinished = [index for index, record in enumerate(records) if record.finished is None]
        raise TimeoutError(f"streams {unfinished} did not finish within {timeout_s:.0f} s")
    for index, record in enumerate(records):
        if record.finished.error:
            raise RuntimeError(f"stream {index} ended badly: {record.finished}")
    return records


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the nearest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")


def write_json(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"figures written to {path}")


def finish(report: dict, json_path: str | None, failure: str | None = None) -> int:
    """Write the figures, with the machine they were measured on, where asked; the exit status: 1
    with the failure said, else 0."""
    report.setdefault("machine", machine_facts())
    write_json(json_path, report)
    if failure:
        print(f"FAILED: {failure}")
        return 1
    return 0

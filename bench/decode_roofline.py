"""Single-stream decode speed against the memory-bandwidth roofline, at tp=1 and tp=2 (issue 2).

One decode step of one stream reads every weight of the rank's shard once, so a rank can never
decode faster than (memory bandwidth) / (weight bytes it reads per token); at tp=2 the rank that
reads more bounds the pair. The bandwidth is measured here, in rank 0's process with its one thread,
by summing a buffer larger than the caches before and after every timed decode burst, and each
burst is set against the bandwidth around it, so both sides of the fraction see the same machine. Each tp runs with batch-invariant products (every product padded to 16 rows,
replies exact whatever the batch) and without (the BLAS's fastest one-row kernels): their ratio is
what exactness costs a single stream. Only decode is timed: prefill and a few warm-up steps are not.

    python -m bench.decode_roofline [--tokens N --bursts B --rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    GREEDY,
    add_common_args,
    bench_settings,
    chat_prompt,
    default_model_dir,
    finish,
    median,
    print_table,
)
from bench.weight_bytes import ELEMENT_SIZES, weight_bytes_per_token  # noqa: E402
from tpserve.generate import open_single_lane, single_stream_leader  # noqa: E402
from tpserve.ranks.model import TPModel  # noqa: E402
from tpserve.ranks.model_config import ModelConfig, load_model_config  # noqa: E402
from tpserve.server.backend import DecodeItem, PrefillItem  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402

LANE = 0
NUM_WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Mode:
    tp_size: int
    batch_invariant: bool

    @property
    def name(self) -> str:
        return f"tp={self.tp_size} {'invariant' if self.batch_invariant else 'fast'}"


def loaded_weight_bytes(model: TPModel) -> int:
    """The same figure counted from the tensors a loaded rank holds (a check on the plan's)."""
    tensors = [model.norm.weight, *model.lm_head.weights]
    for layer in model.layers:  # its products, biases and norms
        tensors += layer.held()
    if not model.config.tie_word_embeddings:
        tensors += [table[:1] for table in model.embed_tokens.tables]
    unique = {tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in tensors}
    return sum(unique.values())


def read_bandwidth(buffer: torch.Tensor) -> float:
    """Bytes per second one thread reads while summing `buffer` (larger than the caches)."""
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start)


@dataclass
class ModeSamples:
    """Timed bursts of one mode, possibly over several rounds."""

    tokens_per_s: list[float]
    bandwidth: list[float]  # bytes/s around each burst: the mean of the samples before and after it
    token_ids: list[int]
    loaded_bytes: int


def sample_mode(
    model_dir: str,
    mode: Mode,
    *,
    dtype: str,
    prompt_ids: Sequence[int],
    num_bursts: int,
    burst_tokens: int,
    bandwidth_bytes: int,
) -> ModeSamples:
    """Prefill one prompt, then decode bursts of `burst_tokens`, with a bandwidth sample before each."""
    num_tokens = NUM_WARMUP_TOKENS + num_bursts * burst_tokens
    settings = bench_settings(
        model_dir,
        dtype=dtype,
        tp_size=mode.tp_size,
        num_lanes=1,
        context_size=len(prompt_ids) + num_tokens + 1,
        batch_invariant=mode.batch_invariant,
    )
    samples = ModeSamples([], [], [], 0)
    with single_stream_leader(settings) as leader:
        samples.loaded_bytes = loaded_weight_bytes(leader.engine.model)
        buffer = torch.ones(bandwidth_bytes // 4, dtype=torch.float32)
        if not open_single_lane(leader, LANE, len(prompt_ids) + num_tokens + 1):
            raise RuntimeError(f"no room for one stream of {len(prompt_ids) + num_tokens + 1} tokens")
        token = leader.prefill(PrefillItem(LANE, 0, tuple(prompt_ids), True, GREEDY))
        position = len(prompt_ids)
        for burst in range(-1, num_bursts):  # burst -1: warm-up, untimed
            count = NUM_WARMUP_TOKENS if burst < 0 else burst_tokens
            before = read_bandwidth(buffer)
            start = time.perf_counter()
            for _ in range(count):
                (token,) = leader.decode([DecodeItem(LANE, position, token, GREEDY)])
                position += 1
                samples.token_ids.append(token)
            elapsed = time.perf_counter() - start
            if burst >= 0:
                samples.tokens_per_s.append(count / elapsed)
                samples.bandwidth.append((before + read_bandwidth(buffer)) / 2)
        leader.close(LANE)
    return samples


def run_decode_roofline(
    model_dir: str,
    *,
    tp_sizes: Sequence[int] = (1, 2),
    dtype: str = "float32",
    num_bursts: int = 3,
    burst_tokens: int = 16,
    num_rounds: int = 1,
    bandwidth_bytes: int = 512 * 2**20,
) -> dict:
    """Every mode (tp x batch_invariant) once per round, in the same order; medians over bursts."""
    config = load_model_config(model_dir)
    prompt_ids = chat_prompt(Tokenizer.from_model_dir(model_dir), 0)
    modes = [Mode(tp, invariant) for tp in tp_sizes for invariant in (True, False)]
    samples: dict[Mode, ModeSamples] = {}
    for _ in range(num_rounds):
        for mode in modes:
            got = sample_mode(
                model_dir,
                mode,
                dtype=dtype,
                prompt_ids=prompt_ids,
                num_bursts=num_bursts,
                burst_tokens=burst_tokens,
                bandwidth_bytes=bandwidth_bytes,
            )
            if mode in samples:
                samples[mode].tokens_per_s += got.tokens_per_s
                samples[mode].bandwidth += got.bandwidth
            else:
                samples[mode] = got
    rows = [_mode_figures(config, mode, samples[mode], ELEMENT_SIZES[dtype]) for mode in modes]
    return {
        "model": model_dir,
        "dtype": dtype,
        "threads_per_rank": 1,
        "prompt_tokens": len(prompt_ids),
        "timed_tokens_per_mode": num_rounds * num_bursts * burst_tokens,
        "load_average": os.getloadavg()[0],
        "modes": rows,
        "ratios": _ratios(rows, tp_sizes),
    }


def _mode_figures(config: ModelConfig, mode: Mode, samples: ModeSamples, element_size: int) -> dict:
    rank_bytes = [weight_bytes_per_token(config, r, mode.tp_size, element_size) for r in range(mode.tp_size)]
    if samples.loaded_bytes != rank_bytes[0]:
        raise RuntimeError(
            f"{mode.name}: rank 0 holds {samples.loaded_bytes} weight bytes, the plan says {rank_bytes[0]}"
        )
    tokens_per_s = median(samples.tokens_per_s)
    bandwidth = median(samples.bandwidth)
    # Each burst against the bandwidth measured around it, so that a busy spell of the machine
    # slows both sides of the fraction alike.
    fractions = [rate * max(rank_bytes) / bw for rate, bw in zip(samples.tokens_per_s, samples.bandwidth)]
    return {
        "mode": mode.name,
        "tp_size": mode.tp_size,
        "batch_invariant": mode.batch_invariant,
        "tokens_per_s": tokens_per_s,
        "ms_per_token": 1000 / tokens_per_s,
        "bytes_per_token": max(rank_bytes),
        "rank_bytes_per_token": rank_bytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tokens_per_s": bandwidth / max(rank_bytes),
        "roofline_fraction": median(fractions),
        "burst_tokens_per_s": samples.tokens_per_s,
        "burst_bandwidth_gb_s": [bw / 1e9 for bw in samples.bandwidth],
        "token_ids": samples.token_ids,
    }


def _ratios(rows: list[dict], tp_sizes: Sequence[int]) -> dict:
    by_key = {(row["tp_size"], row["batch_invariant"]): row for row in rows}
    ratios = {}
    for tp in tp_sizes:
        fast, exact = by_key[(tp, False)], by_key[(tp, True)]
        ratios[f"tp{tp}_invariant_over_fast"] = exact["tokens_per_s"] / fast["tokens_per_s"]
    if 1 in tp_sizes and 2 in tp_sizes:
        for invariant, label in ((True, "invariant"), (False, "fast")):
            one, two = by_key[(1, invariant)], by_key[(2, invariant)]
            ratios[f"tp2_over_tp1_{label}"] = two["tokens_per_s"] / one["tokens_per_s"]
            ratios[f"tp2_tokens_equal_tp1_{label}"] = two["token_ids"] == one["token_ids"]
    return ratios


def print_report(report: dict) -> None:
    rows = [
        (
            row["mode"],
            row["tokens_per_s"],
            row["ms_per_token"],
            row["bytes_per_token"] / 1e6,
            row["bandwidth_gb_s"],
            row["roofline_tokens_per_s"],
            f"{100 * row['roofline_fraction']:.0f}%",
        )
        for row in report["modes"]
    ]
    print_table(
        f"single-stream decode, {report['dtype']}, 1 thread per rank, "
        f"{report['timed_tokens_per_mode']} timed tokens per mode, load average {report['load_average']:.1f}",
        ("mode", "tok/s", "ms/tok", "MB/tok", "GB/s", "roof tok/s", "of roof"),
        rows,
    )
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--tp", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per timed burst")
    parser.add_argument("--bursts", type=int, default=3, help="timed bursts per mode and round")
    parser.add_argument("--rounds", type=int, default=1, help="times every mode runs, in turn")
    parser.add_argument("--bandwidth-mib", type=int, default=512, help="buffer summed to measure bandwidth")
    args = parser.parse_args(argv)
    report = run_decode_roofline(
        args.model or default_model_dir(),
        tp_sizes=tuple(args.tp),
        dtype=args.dtype,
        num_bursts=args.bursts,
        burst_tokens=args.tokens,
        num_rounds=args.rounds,
        bandwidth_bytes=args.bandwidth_mib * 2**20,
    )
    print_report(report)
    return finish(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

"""Timing weight kinds against each other as a decode step meets them: copies cycled out of cache.

Shared by bench/q4_linear.py and bench/q8_linear.py. Each kind holds up to `num_copies` copies of a
weight (as that many layers would) and calls them in turn, so a product reads its weight from
memory, not from the cache the previous call left warm. Kinds are timed side by side, pass after
pass, and each reports its median ms per call; what counts is one kind's ratio to the others,
measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

from bench.common import median, print_table
from tpserve.kernels.block_weights import PATHS
from tpserve.kernels.int8_linear import Int8Weight

MAX_COPY_BYTES = 2**30  # per kind and shape: float32's head copies stop at 1 GiB (still far past L3)
LABELS = {"float32": "f32"}  # short column names


def int8_weight(weight: torch.Tensor) -> Int8Weight:
    packed = Int8Weight(weight)
    packed.nbytes = weight.numel() + 4 * weight.shape[0]  # int8 values and one scale per output
    return packed


class OnPath:
    """A block weight on one named code path (--path avx2 shows what an AVX2-only CPU would run)."""

    def __init__(self, packed, path: str):
        self.packed, self.path, self.nbytes = packed, path, packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, path=self.path)


def time_pass(copies, x: torch.Tensor) -> float:
    """ms per call over one pass through every copy."""
    start = time.perf_counter()
    for weight in copies:
        weight(x)
    return (time.perf_counter() - start) * 1e3 / len(copies)


def time_products(
    kinds: dict[str, Callable], subject: str, shapes, rows, num_copies: int, num_passes: int
) -> list[dict]:
    """One result per shape and row count: each kind's median ms per call, and `subject`'s ratio to
    every other kind (<subject>_over_<kind>) and its bytes over its time (<subject>_gb_s)."""
    gen = torch.Generator().manual_seed(0)
    results = []
    for num_out, num_in in shapes:
        weight = torch.randn(num_out, num_in, generator=gen) * 0.05
        copies = {}
        for kind, make in kinds.items():
            one = make(weight)
            count = max(2, min(num_copies, MAX_COPY_BYTES // one.nbytes))
            copies[kind] = [one] + [make(weight) for _ in range(count - 1)]
        for num_rows in rows:
            x = torch.randn(num_rows, num_in, generator=gen)
            samples = {kind: [] for kind in kinds}
            for kind in kinds:
                time_pass(copies[kind], x)  # warm-up: first touch, lazy builds
            for _ in range(num_passes):
                for kind in kinds:
                    samples[kind].append(time_pass(copies[kind], x))
            ms = {kind: median(values) for kind, values in samples.items()}
            result = {
                "shape": [num_out, num_in],
                "rows": num_rows,
                "copies": {kind: len(c) for kind, c in copies.items()},
                "ms": ms,
                "samples_ms": samples,
            }
            for kind in kinds:
                if kind != subject:
                    result[f"{subject}_over_{kind}"] = ms[subject] / ms[kind]
            result[f"{subject}_gb_s"] = copies[subject][0].nbytes / (ms[subject] * 1e-3) / 1e9
            result["bytes"] = {kind: c[0].nbytes for kind, c in copies.items()}
            results.append(result)
        del copies
    return results


def product_args(doc: str, path_help: str, argv=None) -> argparse.Namespace:
    """A product benchmark's flags: --rows, --copies, --passes, --path (path_help) and --json."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--copies", type=int, default=30, help="copies of each weight, called in turn")
    parser.add_argument("--passes", type=int, default=7, help="timed passes per kind (median)")
    parser.add_argument("--path", choices=PATHS, default="auto", help=path_help)
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")
    return parser.parse_args(argv)


def print_products(report: dict, subject: str, others: Sequence[str], kernels: str) -> None:
    """A report's time_products results as a table: ms per kind, then subject's ratios to `others`
    and its GB/s; `kernels` names the block kinds that ran on the report's path."""
    results = report["results"]
    kinds = list(results[0]["ms"]) if results else []
    print_table(
        f"ms per call, one thread ({kernels} on path {report['path']}; paths here: {', '.join(report['paths'])})",
        ["out x in", "rows", *kinds]
        + [f"{subject}/{LABELS.get(kind, kind)}" for kind in others]
        + [f"{subject} GB/s"],
        [
            [f"{r['shape'][0]}x{r['shape'][1]}", r["rows"], *(r["ms"][kind] for kind in kinds)]
            + [r[f"{subject}_over_{kind}"] for kind in others]
            + [r[f"{subject}_gb_s"]]
            for r in results
        ],
    )

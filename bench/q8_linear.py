"""8-bit block weights against int8 and 4 bits: ms per product on one thread, weights cycled out of cache.

At the shapes of one tp=2 rank's vocabulary half of SmolLM2's tied head (24576 x 576) and its
gate/up piece (1536 x 576), each kind holds `--copies` copies of every weight and calls them in
turn, as in bench/q4_linear.py, so a product reads its weight from memory the way a decode step
does. Kinds are timed side by side, pass after pass, each reporting its median ms per call; the
ratio q8 / int8 is what counts (issue 13's target: about 1.2 at 1 and 16 rows, both reading about a
byte a weight). A second table times the embedding lookup `rows(ids)` from the head's 8-bit copy
against float32's `F.embedding`. Every kind runs one thread.

    python -m bench.q8_linear [--rows 1 4 16 64] [--copies 30] [--passes 7] [--path avx2] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import finish, median, print_table  # noqa: E402
from bench.q4_linear import int8_weight, time_pass  # noqa: E402
from tpserve.kernels.q4_linear import PATHS, Q4Weight  # noqa: E402
from tpserve.kernels.q8_linear import Q8Weight, supported_paths  # noqa: E402

SHAPES = ((24576, 576), (1536, 576))  # SmolLM2-135M at tp=2: the head's half, gate/up
LOOKUPS = (1, 16, 512)  # embedding rows per lookup: a decode round's few, a prompt's many


class OnPath:
    """A block weight on one named code path (--path avx2 shows what an AVX2-only CPU would run)."""

    def __init__(self, packed, path: str):
        self.packed, self.path, self.nbytes = packed, path, packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, path=self.path)


def run_products(rows, num_copies: int, num_passes: int, shapes, path: str) -> list[dict]:
    kinds = {
        "int8": int8_weight,
        "q4": lambda weight: OnPath(Q4Weight(weight), path),
        "q8": lambda weight: OnPath(Q8Weight(weight), path),
    }
    gen = torch.Generator().manual_seed(0)
    results = []
    for num_out, num_in in shapes:
        weight = torch.randn(num_out, num_in, generator=gen) * 0.05
        copies = {kind: [make(weight) for _ in range(num_copies)] for kind, make in kinds.items()}
        for num_rows in rows:
            x = torch.randn(num_rows, num_in, generator=gen)
            samples = {kind: [] for kind in kinds}
            for kind in kinds:
                time_pass(copies[kind], x)  # warm-up: first touch, lazy builds
            for _ in range(num_passes):
                for kind in kinds:
                    samples[kind].append(time_pass(copies[kind], x))
            ms = {kind: median(values) for kind, values in samples.items()}
            results.append(
                {
                    "shape": [num_out, num_in],
                    "rows": num_rows,
                    "copies": num_copies,
                    "ms": ms,
                    "samples_ms": samples,
                    "q8_over_int8": ms["q8"] / ms["int8"],
                    "q8_over_q4": ms["q8"] / ms["q4"],
                    "q8_gb_s": copies["q8"][0].nbytes / (ms["q8"] * 1e-3) / 1e9,
                    "bytes": {kind: c[0].nbytes for kind, c in copies.items()},
                }
            )
        del copies
    return results


def run_lookups(num_passes: int, shape=SHAPES[0], repeats: int = 200) -> list[dict]:
    """µs per lookup of n random rows: Q8Weight.rows against F.embedding on the float32 weight."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=gen) * 0.05
    packed = Q8Weight(weight)
    results = []
    for num_ids in LOOKUPS:
        ids = torch.randint(0, shape[0], (num_ids,), generator=gen)
        kinds = {"float32": lambda ids: F.embedding(ids, weight), "q8": packed.rows}
        samples = {kind: [] for kind in kinds}
        for _ in range(num_passes):
            for kind, lookup in kinds.items():
                start = time.perf_counter()
                for _ in range(repeats):
                    lookup(ids)
                samples[kind].append((time.perf_counter() - start) * 1e6 / repeats)
        us = {kind: median(values) for kind, values in samples.items()}
        results.append({"ids": num_ids, "us": us, "q8_over_float32": us["q8"] / us["float32"]})
    return results


def run_q8_linear(
    rows=(1, 4, 16, 64), num_copies: int = 30, num_passes: int = 7, shapes=SHAPES, path: str = "auto"
) -> dict:
    torch.set_num_threads(1)
    return {
        "path": path,
        "paths": supported_paths(),
        "results": run_products(rows, num_copies, num_passes, shapes, path),
        "lookups": run_lookups(num_passes, shapes[0]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--copies", type=int, default=30, help="copies of each weight, called in turn")
    parser.add_argument("--passes", type=int, default=7, help="timed passes per kind (median)")
    parser.add_argument("--path", choices=PATHS, default="auto", help="the block kernels' code path")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")
    args = parser.parse_args(argv)
    report = run_q8_linear(tuple(args.rows), args.copies, args.passes, path=args.path)
    print_table(
        f"ms per call, one thread (q4 and q8 on path {args.path}; paths here: {', '.join(report['paths'])})",
        ["out x in", "rows", "int8", "q4", "q8", "q8/int8", "q8/q4", "q8 GB/s"],
        [
            [
                f"{r['shape'][0]}x{r['shape'][1]}",
                r["rows"],
                r["ms"]["int8"],
                r["ms"]["q4"],
                r["ms"]["q8"],
                r["q8_over_int8"],
                r["q8_over_q4"],
                r["q8_gb_s"],
            ]
            for r in report["results"]
        ],
    )
    print_table(
        "embedding lookup, µs per call of n random rows (the head's 8-bit copy against float32)",
        ["ids", "float32", "q8 rows", "q8/f32"],
        [[r["ids"], r["us"]["float32"], r["us"]["q8"], r["q8_over_float32"]] for r in report["lookups"]],
    )
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())

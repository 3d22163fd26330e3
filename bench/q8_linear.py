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

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.block_timing import OnPath, int8_weight, print_products, product_args, time_products  # noqa: E402
from bench.common import finish, median, print_table  # noqa: E402
from tpserve.kernels.q4_linear import Q4Weight  # noqa: E402
from tpserve.kernels.q8_linear import Q8Weight, supported_paths  # noqa: E402

SHAPES = ((24576, 576), (1536, 576))  # SmolLM2-135M at tp=2: the head's half, gate/up
LOOKUPS = (1, 16, 512)  # embedding rows per lookup: a decode round's few, a prompt's many


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
    kinds = {
        "int8": int8_weight,
        "q4": lambda weight: OnPath(Q4Weight(weight), path),
        "q8": lambda weight: OnPath(Q8Weight(weight), path),
    }
    return {
        "path": path,
        "paths": supported_paths(),
        "results": time_products(kinds, "q8", shapes, rows, num_copies, num_passes),
        "lookups": run_lookups(num_passes, shapes[0]),
    }


def main(argv=None) -> int:
    args = product_args(__doc__, "the block kernels' code path", argv)
    report = run_q8_linear(tuple(args.rows), args.copies, args.passes, path=args.path)
    print_products(report, "q8", ("int8", "q4"), kernels="q4 and q8")
    print_table(
        "embedding lookup, µs per call of n random rows (the head's 8-bit copy against float32)",
        ["ids", "float32", "q8 rows", "q8/f32"],
        [[r["ids"], r["us"]["float32"], r["us"]["q8"], r["q8_over_float32"]] for r in report["lookups"]],
    )
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())

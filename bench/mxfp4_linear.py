"""MXFP4 block weights (gpt-oss's experts, as stored) against the same values in 5-bit blocks, 4 bits and
float32: ms per product on one thread, weights cycled out of cache.

At gpt-oss-20b's expert shapes (hidden 2880, intermediate 2880): one expert's down at tp=1, or its
gate/up piece at tp=2 (2880 x 2880), and its down piece at tp=2 (2880 x 1440). Each kind holds
`--copies` copies of every weight and calls them in turn, as in bench/q4_linear.py, so a product
reads its weight from memory the way a decode step does. Kinds are timed side by side, pass after
pass, each reporting its median ms per call; the ratios mxfp4 / q5 (against serving the same values
in 5-bit Q5_0-layout blocks, 6 bits a weight, as `int4` did before this kernel) and mxfp4 / q4 are
what counts. Every kind runs one thread.

    python -m bench.mxfp4_linear [--rows 1 16] [--copies 30] [--passes 7] [--path avx2] [--json FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.block_timing import OnPath, print_products, product_args, time_products  # noqa: E402
from bench.common import finish  # noqa: E402
from bench.q4_linear import FloatWeight  # noqa: E402
from tpserve.kernels.mxfp4_linear import KERNEL, Mxfp4Weight, e2m1_values, scale_values  # noqa: E402
from tpserve.kernels.q4_linear import Q4Weight  # noqa: E402
from tpserve.kernels.q5_linear import Q5Weight  # noqa: E402

SHAPES = ((2880, 2880), (2880, 1440))  # gpt-oss-20b's expert: down (or gate/up at tp=2), down at tp=2


def as_five_bit(weight: Mxfp4Weight) -> Q5Weight:
    """The same values in 5-bit blocks, as `int4` served MXFP4 experts before: q = 2 v + 16 (4..28),
    d = 2^(s - 128), m = -16 d, exact (float16 scales where they hold every one)."""
    codes, scales = weight.blocks()
    q = (2 * e2m1_values()[codes.long()] + 16).to(torch.uint8)
    d = scale_values()[scales.long()] / 2
    return Q5Weight.from_blocks(q, d, -16 * d)


def run_mxfp4_linear(
    rows=(1, 16), num_copies: int = 30, num_passes: int = 7, shapes=SHAPES, path: str = "auto"
) -> dict:
    torch.set_num_threads(1)
    kinds = {
        "float32": FloatWeight,
        "q4": lambda weight: OnPath(Q4Weight(weight), path),
        "q5": lambda weight: OnPath(as_five_bit(Mxfp4Weight(weight)), path),
        "mxfp4": lambda weight: OnPath(Mxfp4Weight(weight), path),
    }
    results = time_products(kinds, "mxfp4", shapes, rows, num_copies, num_passes)
    return {"path": path, "paths": KERNEL.supported_paths(), "results": results}


def main(argv=None) -> int:
    args = product_args(__doc__, "the block kernels' code path", argv)
    report = run_mxfp4_linear(tuple(args.rows), args.copies, args.passes, path=args.path)
    print_products(report, "mxfp4", ("float32", "q5", "q4"), kernels="q4, q5 and mxfp4")
    held = {tuple(r["shape"]): r["bytes"] for r in report["results"]}  # per shape, whatever the rows
    for (num_out, num_in), kinds in held.items():
        ratio = kinds["mxfp4"] / kinds["q5"]
        print(f"{num_out}x{num_in}: bytes mxfp4 {kinds['mxfp4']}, q5 {kinds['q5']} (mxfp4/q5 {ratio:.3f})")
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())

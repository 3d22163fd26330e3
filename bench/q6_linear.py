"""6-bit block weights (GGUF's Q6_K) against float32, 4, 5 and 8 bits: ms per product on one thread,
weights cycled out of cache.

At one tp=2 rank's gate/up piece of SmolLM2 (1536 x 576) and its half of the head (24576 x 576: a
Q4_K_M file keeps its head in Q6_K), each kind holds `--copies` copies of every weight and calls them
in turn, as in bench/q4_linear.py, so a product reads its weight from memory the way a decode step
does. Kinds are timed side by side, pass after pass, each reporting its median ms per call; the
ratios q6 / float32 and q6 / q4 are what counts (what serving a Q6_K tensor as stored costs against
rounding it to 4 bits). `q5f32` is the 5-bit kernel on the float32-scale layout a Q5_K tensor is
served in (640 bytes per 16 outputs x 32 inputs). Every kind runs one thread.

    python -m bench.q6_linear [--rows 1 16] [--copies 30] [--passes 7] [--path avx2] [--json FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.block_timing import OnPath, print_products, product_args, time_products  # noqa: E402
from bench.common import finish  # noqa: E402
from bench.q4_linear import FloatWeight, q4_float32_scales  # noqa: E402
from tpserve.kernels.q4_linear import Q4Weight  # noqa: E402
from tpserve.kernels.q5_linear import Q5Weight  # noqa: E402
from tpserve.kernels.q6_linear import KERNEL, Q6Weight  # noqa: E402
from tpserve.kernels.q8_linear import Q8Weight  # noqa: E402

SHAPES = ((1536, 576), (24576, 576))  # SmolLM2-135M at tp=2: gate/up, the head's half


def run_q6_linear(
    rows=(1, 16), num_copies: int = 30, num_passes: int = 7, shapes=SHAPES, path: str = "auto"
) -> dict:
    torch.set_num_threads(1)
    kinds = {
        "float32": FloatWeight,
        "q4": lambda weight: OnPath(Q4Weight(weight), path),
        "q5f32": lambda weight: OnPath(q4_float32_scales(weight, Q5Weight), path),
        "q8": lambda weight: OnPath(Q8Weight(weight), path),
        "q6": lambda weight: OnPath(Q6Weight(weight), path),
    }
    results = time_products(kinds, "q6", shapes, rows, num_copies, num_passes)
    return {"path": path, "paths": KERNEL.supported_paths(), "results": results}


def main(argv=None) -> int:
    args = product_args(__doc__, "the block kernels' code path", argv)
    report = run_q6_linear(tuple(args.rows), args.copies, args.passes, path=args.path)
    print_products(report, "q6", ("float32", "q4", "q8"), kernels="q4, q5, q8 and q6")
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())

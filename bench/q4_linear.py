"""4-bit weights against int8 and float32: ms per product on one thread, weights cycled out of cache.

At SmolLM2's rank shapes ([out, in] of one tp=2 rank's q/k/v, o, gate/up and down pieces, and its
vocabulary half of the head), each kind holds `--copies` copies of every weight (as that many layers
would) and calls them in turn, so a product reads its weight from memory the way a decode step
does, not from the cache the previous call left warm. Kinds are timed side by side, pass after
pass, and each reports its median ms per call; the ratios q4 / int8 and q4 / float32 are what
counts (issue 13's targets: <= 1.0 at one row, about 1.3 at 16). Every kind runs one thread.
`q4f32` is the same kernel on the float32-scale layout a Q4_K import is served in (384 bytes per
16 outputs x 32 inputs against 320): the column q4/q4f32 is what those wider scales cost.

    python -m bench.q4_linear [--rows 1 4 16 64] [--copies 30] [--passes 7] [--path avx2] [--json FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.block_timing import OnPath, int8_weight, print_products, product_args, time_products  # noqa: E402
from bench.common import finish  # noqa: E402
from tpserve.kernels.block_weights import BLOCK  # noqa: E402
from tpserve.kernels.q4_linear import Q4Weight, supported_paths  # noqa: E402

SHAPES = ((640, 576), (576, 384), (1536, 576), (576, 768), (24576, 576))  # SmolLM2-135M at tp=2


class FloatWeight:
    def __init__(self, weight: torch.Tensor):
        self.weight, self.nbytes = weight.clone(), weight.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def q4_float32_scales(weight: torch.Tensor, kind: type[Q4Weight] = Q4Weight) -> Q4Weight:
    """4-bit blocks with unrounded float32 scales (min and (max - min) / 15), as a Q4_K's d * sc and
    -dmin * mn: packed in the float32-scale layout (5-bit ones for kind Q5Weight, as a Q5_K's)."""
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    m = blocks.amin(dim=-1)
    d = (blocks.amax(dim=-1) - m) / kind.VALUE_MAX
    q = ((blocks - m[..., None]) / d[..., None]).round().clamp(0, kind.VALUE_MAX).to(torch.uint8)
    packed = kind.from_blocks(q.view(weight.shape), d, m)
    if packed.scale_dtype != torch.float32:
        raise RuntimeError("float16 held every scale: the float32 layout was not measured")
    return packed


def run_q4_linear(
    rows=(1, 4, 16, 64), num_copies: int = 30, num_passes: int = 7, shapes=SHAPES, path: str = "auto"
) -> dict:
    torch.set_num_threads(1)
    kinds = {
        "float32": FloatWeight,
        "int8": int8_weight,
        "q4": lambda weight: OnPath(Q4Weight(weight), path),
        "q4f32": lambda weight: OnPath(q4_float32_scales(weight), path),
    }
    results = time_products(kinds, "q4", shapes, rows, num_copies, num_passes)
    return {"path": path, "paths": supported_paths(), "results": results}


def main(argv=None) -> int:
    args = product_args(__doc__, "the q4 kernel's code path", argv)
    report = run_q4_linear(tuple(args.rows), args.copies, args.passes, path=args.path)
    print_products(report, "q4", ("int8", "float32", "q4f32"), kernels="q4")
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())

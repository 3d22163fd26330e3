"""The float16 kernel (the int8 format's down_proj) against the products it could have been: ms per call.

At SmolLM2-135M's down_proj, whole (576 x 1536, tp=1) and one tp=2 rank's piece (576 x 768), each
kind holds `--copies` copies of the weight and calls them in turn (bench/block_timing.py), so a
product reads its weight from memory as a decode step does. Kinds, all on one thread:
- fp16: tpserve/kernels/fp16_linear.py's C kernel (on `--path`), batch-invariant by construction;
- fbgemm: FBGEMM's float16 product called on the rows as they come (what served before; not
  batch-invariant on an AVX2 CPU);
- fbgemm16: the same in tiles of 16 rows (the C kernel's fallback);
- f32: the float32 weight through tpserve/kernels/linear.py's 16-row tiles.

    python -m bench.fp16_linear [--rows 1 16 64] [--copies 30] [--passes 7] [--path avx2] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.block_timing import print_products, time_products  # noqa: E402
from bench.common import finish  # noqa: E402
from tpserve.kernels import fp16_linear  # noqa: E402
from tpserve.kernels.linear import ROW_TILE, linear  # noqa: E402

SHAPES = ((576, 1536), (576, 768))  # SmolLM2-135M's down_proj: tp=1, and a tp=2 rank's piece


class Kind:
    """A product of one weight, with the bytes it reads."""

    def __init__(self, call, nbytes: int):
        self.call, self.nbytes = call, nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)


def _fbgemm(weight: torch.Tensor, tile: int) -> Kind:
    packed = torch.ops.quantized.linear_prepack_fp16(weight, None)

    def call(x):
        if not tile:
            return torch.ops.quantized.linear_dynamic_fp16(x, packed)
        rows = torch.nn.functional.pad(x, (0, 0, 0, -x.shape[0] % tile))
        tiles = [torch.ops.quantized.linear_dynamic_fp16(t, packed) for t in rows.split(tile)]
        return torch.cat(tiles)[: x.shape[0]]

    return Kind(call, 2 * weight.numel())


def _ours(weight: torch.Tensor, path: str) -> Kind:
    packed = fp16_linear.Fp16Weight(weight)
    return Kind(lambda x: packed(x, path=path), packed.nbytes)


def run_fp16_linear(rows=(1, 16, 64), num_copies=30, num_passes=7, shapes=SHAPES, path="auto") -> dict:
    torch.set_num_threads(1)
    torch.backends.quantized.engine = "fbgemm"
    kinds = {
        "fp16": lambda weight: _ours(weight, path),
        "fbgemm": lambda weight: _fbgemm(weight, 0),
        "fbgemm16": lambda weight: _fbgemm(weight, ROW_TILE),
        "float32": lambda weight: Kind(lambda x: linear(x, weight, None, ROW_TILE), 4 * weight.numel()),
    }
    return {
        "path": path,
        "paths": fp16_linear.supported_paths(),
        "results": time_products(kinds, "fp16", shapes, rows, num_copies, num_passes),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--copies", type=int, default=30, help="copies of each weight, called in turn")
    parser.add_argument("--passes", type=int, default=7, help="timed passes per kind (median)")
    parser.add_argument("--path", choices=fp16_linear.PATHS, default="auto", help="the C kernel's path")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")
    args = parser.parse_args(argv)
    report = run_fp16_linear(tuple(args.rows), args.copies, args.passes, path=args.path)
    print_products(report, "fp16", ("fbgemm", "fbgemm16", "float32"), kernels="fp16")
    return finish(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

"""What the block weight tests (test_block_weights.py, test_q4_linear.py, test_q8_linear.py) share: the
two kinds, the paths each runs here, and the weights and rows they are tried on."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels import q4_linear, q8_linear
from tpserve.kernels.block_weights import BLOCK, BlockKernel

# Output counts that fill whole groups of 16, leave a lone group (the VNNI path pairs groups), and
# end in a part of a group (the stores are masked).
SHAPES = [(64, 96), (48, 64), (100, 96), (5, 32)]

KINDS = (("q4", q4_linear.Q4Weight, q4_linear.KERNEL), ("q8", q8_linear.Q8Weight, q8_linear.KERNEL))
BITS = {q4_linear.Q4Weight: "4-bit", q8_linear.Q8Weight: "8-bit"}  # how their refusals name them


def paths_here(kernel: BlockKernel) -> list[str]:
    """The kernel's paths this CPU runs; none where it does not build (its tests skip by name)."""
    return kernel.supported_paths() if kernel.unavailable() is None else []


def kinds(*, each_path: bool = False) -> list:
    """pytest parameters (weight class, kernel) for both kinds, or (weight class, kernel, path) for
    "auto" and each path this CPU runs; skipped by name where a kernel does not build."""
    params = []
    for name, kind, kernel in KINDS:
        why_not = kernel.unavailable()
        skip = pytest.mark.skipif(why_not is not None, reason=str(why_not))
        if not each_path:
            params.append(pytest.param(kind, kernel, id=name, marks=skip))
            continue
        for path in ["auto", *paths_here(kernel)]:
            params.append(pytest.param(kind, kernel, path, id=f"{name}-{path}", marks=skip))
    return params


def weight_and_rows(num_out=100, num_in=96, num_rows=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=gen) * 0.05
    # Rows of very different sizes, one of zeros (a padding row), one block of zeros in another.
    rows = torch.randn(num_rows, num_in, generator=gen) * torch.rand(num_rows, 1, generator=gen) * 8
    rows[3] = 0
    rows[5, :BLOCK] = 0
    return weight, rows

"""What the block weight tests (test_block_weights.py, test_q4_linear.py, test_q8_linear.py,
test_q6_linear.py, test_q5_linear.py, test_mxfp4_linear.py) share: the kinds, the paths each runs here, and the weights and rows they are tried on."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels import mxfp4_linear, q4_linear, q5_linear, q6_linear, q8_linear
from tpserve.kernels.block_weights import BLOCK, BlockKernel, check_block_shape

# Output counts that fill whole groups of 16, leave a lone group (the VNNI path pairs groups), and
# end in a part of a group (the stores are masked).
SHAPES = [(64, 96), (48, 64), (100, 96), (5, 32)]


def float32_scales(kind: type[q4_linear.Q4Weight]):
    """A float weight in 4-bit (or 5-bit) blocks whose scales are float32, as a Q4_K (Q5_K) import's
    (d * sc and -dmin * mn): min and (max - min) / 15 (31) per block, unrounded, so float16 holds
    hardly any."""

    def make(weight: torch.Tensor) -> q4_linear.Q4Weight:
        check_block_shape(weight, kind.BITS)
        blocks = weight.float().view(weight.shape[0], -1, BLOCK)
        m = blocks.amin(dim=-1)
        d = (blocks.amax(dim=-1) - m) / kind.VALUE_MAX
        q = ((blocks - m[..., None]) / d.clamp_min(1e-30)[..., None]).round().clamp(0, kind.VALUE_MAX)
        packed = kind.from_blocks(q.to(torch.uint8).view(weight.shape), d, m)
        assert packed.scale_dtype == torch.float32
        return packed

    return make


q4_float32_scales = float32_scales(q4_linear.Q4Weight)
q5_float32_scales = float32_scales(q5_linear.Q5Weight)
KINDS = (
    ("q4", q4_linear.Q4Weight, q4_linear.KERNEL),
    ("q4f32", q4_float32_scales, q4_linear.KERNEL_F32),
    ("q5", q5_linear.Q5Weight, q5_linear.KERNEL),
    ("q5f32", q5_float32_scales, q5_linear.KERNEL_F32),
    ("q8", q8_linear.Q8Weight, q8_linear.KERNEL),
    ("q6", q6_linear.Q6Weight, q6_linear.KERNEL),
    ("mxfp4", mxfp4_linear.Mxfp4Weight, mxfp4_linear.KERNEL),
)
# how their refusals name them
BITS = {
    q4_linear.Q4Weight: "4-bit",
    q4_float32_scales: "4-bit",
    q5_linear.Q5Weight: "5-bit",
    q5_float32_scales: "5-bit",
    q8_linear.Q8Weight: "8-bit",
    q6_linear.Q6Weight: "6-bit",
    mxfp4_linear.Mxfp4Weight: "MXFP4",
}


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

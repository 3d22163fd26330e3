"""Every block weight (tpserve/kernels/q4_linear.py, q5_linear.py, q8_linear.py, q6_linear.py,
mxfp4_linear.py): a row is the same at any batch and on every code path the CPU runs, and the product is
its quantized operands' product, near the float one. What differs between them (their extreme blocks,
rounding, layouts, refusals) is tested in test_q4_linear.py, test_q8_linear.py, test_q6_linear.py and
test_mxfp4_linear.py."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from block_cases import BITS, SHAPES, kinds, weight_and_rows

from tpserve.kernels.block_weights import BLOCK
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError
from tpserve.kernels.machine import machine_facts


@pytest.mark.parametrize("kind, kernel, path", kinds(each_path=True))
def test_a_row_is_the_same_alone_among_any_number_of_rows_and_anywhere_in_them(kind, kernel, path):
    weight, rows = weight_and_rows()
    packed = kind(weight)
    alone = torch.cat([packed(rows[i : i + 1], path=path) for i in range(len(rows))])
    for num_rows in range(1, 65):
        assert torch.equal(packed(rows[:num_rows], path=path), alone[:num_rows]), f"{num_rows} rows"
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
    assert torch.equal(packed(rows[order], path=path), alone[order])
    assert torch.equal(packed(rows[10:11].expand(9, -1), path=path), alone[10:11].expand(9, -1))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind, kernel", kinds())
def test_every_path_this_cpu_runs_gives_the_scalar_paths_bits(kind, kernel, shape):
    weight, rows = weight_and_rows(*shape, num_rows=67)
    packed = kind(weight)
    for num_rows in (1, 2, 3, 4, 5, 7, 16, 67):
        scalar = packed(rows[:num_rows], path="scalar")
        for path in kernel.supported_paths():
            assert torch.equal(packed(rows[:num_rows], path=path), scalar), f"{path}, {num_rows} rows"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the vector paths are x86's")
@pytest.mark.parametrize("kind, kernel", kinds())
def test_the_kernel_offers_every_path_the_cpu_announces(kind, kernel):
    # The dispatch's own view (cpuid) against /proc/cpuinfo's: a path that went missing would
    # otherwise skip its checks above in silence.
    flags = set(machine_facts()["vector_extensions"])
    expected = ["scalar"]
    if {"avx2", "fma", "f16c"} <= flags:
        expected.append("avx2")
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        expected.append("avx512_vnni")
    assert kernel.supported_paths() == expected


def emulated(weight: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """The same quantized operands multiplied in float64: what the kernel computes, less its float32
    rounding."""
    blocks = rows.view(rows.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(scale > 0, blocks / scale.clamp_min(1e-30), 0).clamp(-127, 127).round()
    return (codes.double() * scale.double()).view_as(rows) @ weight.dequantize().double().t()


@pytest.mark.parametrize("kind, kernel", kinds())
def test_the_product_is_its_quantized_operands_product_and_near_the_float_one(kind, kernel):
    weight, rows = weight_and_rows()
    packed = kind(weight)
    assert isinstance(packed, PackedWeight)  # tpserve/kernels/linear.py's linear() dispatches on it
    bias = torch.randn(weight.shape[0])
    got = packed(rows, bias)
    assert got.shape == (len(rows), weight.shape[0]) and got.dtype == torch.float32
    assert torch.equal(got[3], bias), "a row of zeros gives the bias alone"
    got = got - bias
    # Against the exact product of the very operands: float32 rounding of the per-block epilogue only
    # (3 blocks, each an exact integer times d * da, summed in float32: a few 1e-7 relative).
    exact = emulated(packed, rows)
    assert ((got.double() - exact).norm() / exact.norm()) < 1e-5
    # Against the float product with the quantized weight: the input's 8-bit rounding only. A block
    # rounds to steps of absmax / 127 with an error of rms step / sqrt(12); a block of 32 Gaussian
    # values has absmax about 2-2.5 sigma, so the relative error of a row is about 2.5 / (127 * 3.46)
    # = 0.6%.
    reference = F.linear(rows, packed.dequantize())
    error = (got - reference).norm() / reference.norm()
    assert 0 < error < 0.01, f"relative error {error:.4f}"


@pytest.mark.parametrize("kind, kernel", kinds())
def test_inputs_in_part_blocks_a_wrong_width_and_unknown_paths_are_refused_by_name(kind, kernel):
    with pytest.raises(QuantizeError, match=rf"{BITS[kind]} weights need .* multiple of 32, got \[16, 48\]"):
        kind(torch.randn(16, 48))
    packed = kind(torch.randn(16, 64))
    with pytest.raises(ValueError, match=r"a \[T, 64\] input expected by a \[16, 64\] weight, got \[2, 32\]"):
        packed(torch.ones(2, 32))
    with pytest.raises(ValueError, match="unknown path 'sse'"):
        packed(torch.ones(2, 64), path="sse")

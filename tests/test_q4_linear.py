"""4-bit weights (kernels/q4_linear.py): a row is the same at any batch and on every code path, near the
float product, packed blocks come back exactly, and bad input is refused by name."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from tpserve.kernels.int8_linear import QuantizeError
from tpserve.kernels.machine import machine_facts
from tpserve.kernels.q4_linear import BLOCK, Q4Weight, q4_available, supported_paths

pytestmark = pytest.mark.skipif(q4_available() is not None, reason=str(q4_available()))

# Output counts that fill whole groups of 16, leave a lone group (the VNNI path pairs groups), and
# end in a part of a group (the stores are masked).
SHAPES = [(64, 96), (48, 64), (100, 96), (5, 32)]


def weight_and_rows(num_out=100, num_in=96, num_rows=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=gen) * 0.05
    # Rows of very different sizes, one of zeros (a padding row), one block of zeros in another.
    rows = torch.randn(num_rows, num_in, generator=gen) * torch.rand(num_rows, 1, generator=gen) * 8
    rows[3] = 0
    rows[5, :BLOCK] = 0
    return weight, rows


@pytest.mark.parametrize("path", ["auto", *supported_paths()])
def test_a_row_is_the_same_alone_among_any_number_of_rows_and_anywhere_in_them(path):
    weight, rows = weight_and_rows()
    packed = Q4Weight(weight)
    alone = torch.cat([packed(rows[i : i + 1], path=path) for i in range(len(rows))])
    for num_rows in range(1, 65):
        assert torch.equal(packed(rows[:num_rows], path=path), alone[:num_rows]), f"{num_rows} rows"
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
    assert torch.equal(packed(rows[order], path=path), alone[order])
    assert torch.equal(packed(rows[10:11].expand(9, -1), path=path), alone[10:11].expand(9, -1))


@pytest.mark.parametrize("shape", SHAPES)
def test_every_path_this_cpu_runs_gives_the_scalar_paths_bits(shape):
    weight, rows = weight_and_rows(*shape, num_rows=67)
    packed = Q4Weight(weight)
    for num_rows in (1, 2, 3, 4, 5, 7, 16, 67):
        scalar = packed(rows[:num_rows], path="scalar")
        for path in supported_paths():
            assert torch.equal(packed(rows[:num_rows], path=path), scalar), f"{path}, {num_rows} rows"
    # Extreme blocks: every nibble 15 against inputs at +-absmax (the largest int16 pair sums on AVX2).
    q = torch.full(shape, 15, dtype=torch.uint8)
    scales = torch.full((shape[0], shape[1] // BLOCK), 0.01)
    extreme = Q4Weight.from_blocks(q, scales, -scales)
    signs = torch.tensor([1.0, -1.0]).repeat(shape[1] // 2)
    for x in (torch.ones(3, shape[1]), -torch.ones(3, shape[1]), signs.expand(3, -1)):
        for path in supported_paths():
            assert torch.equal(extreme(x, path=path), extreme(x, path="scalar")), path


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the vector paths are x86's")
def test_the_kernel_offers_every_path_the_cpu_announces():
    # The dispatch's own view (cpuid) against /proc/cpuinfo's: a path that went missing would
    # otherwise skip its checks above in silence.
    flags = set(machine_facts()["vector_extensions"])
    expected = ["scalar"]
    if {"avx2", "fma"} <= flags:
        expected.append("avx2")
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        expected.append("avx512_vnni")
    assert supported_paths() == expected


def emulated(weight: Q4Weight, rows: torch.Tensor) -> torch.Tensor:
    """The same quantized operands multiplied in float64: what the kernel computes, less its float32
    rounding."""
    blocks = rows.view(rows.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(scale > 0, blocks / scale.clamp_min(1e-30), 0).clamp(-127, 127).round()
    return (codes.double() * scale.double()).view_as(rows) @ weight.dequantize().double().t()


def test_the_product_is_its_quantized_operands_product_and_near_the_float_one():
    weight, rows = weight_and_rows()
    packed = Q4Weight(weight)
    bias = torch.randn(weight.shape[0])
    got = packed(rows, bias)
    assert got.shape == (len(rows), weight.shape[0]) and got.dtype == torch.float32
    assert torch.equal(got[3], bias), "a row of zeros gives the bias alone"
    got = got - bias
    # Against the exact product of the very operands: float32 rounding of the per-block epilogue only.
    exact = emulated(packed, rows)
    assert ((got.double() - exact).norm() / exact.norm()) < 1e-5
    # Against the float product with the 4-bit weight: the input's 8-bit rounding only. A block rounds
    # to steps of absmax / 127 with an error of rms step / sqrt(12); a block of 32 Gaussian values has
    # absmax about 2-2.5 sigma, so the relative error of a row is about 2.5 / (127 * 3.46) = 0.6%.
    reference = F.linear(rows, packed.dequantize())
    error = (got - reference).norm() / reference.norm()
    assert 0 < error < 0.01, f"relative error {error:.4f}"
    # The 4-bit weight is the float one within half a step of its block.
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    step = (blocks.amax(dim=-1) - blocks.amin(dim=-1)) / 15
    gap = (packed.dequantize() - weight).abs().view_as(blocks).amax(dim=-1)
    assert (gap <= step / 2 * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blocks_come_back_exactly_as_d_times_q_plus_m(scale_dtype):
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (40, 128), generator=gen, dtype=torch.uint8)
    d = (torch.rand(40, 4, generator=gen) * 0.1).to(scale_dtype)
    for m in ((torch.randn(40, 4, generator=gen) * 0.1).to(scale_dtype), -8 * d):  # Q4_1, then Q4_0
        packed = Q4Weight.from_blocks(q, d, m)
        expected = q.float().view(40, 4, BLOCK) * d.float()[..., None] + m.float()[..., None]
        assert torch.equal(packed.dequantize(), expected.view(40, 128))
    # About half a byte a weight, and a quarter for the float32 block scales.
    assert packed.nbytes == 48 * 128 * 3 // 4  # 40 outputs padded to 3 groups of 16
    assert packed.shape == (40, 128) and packed.dtype == torch.float32


def test_bad_input_is_refused_by_name():
    q = torch.zeros(16, 64, dtype=torch.uint8)
    d = torch.ones(16, 2)
    with pytest.raises(QuantizeError, match=r"multiple of 32, got \[16, 48\]"):
        Q4Weight(torch.randn(16, 48))
    with pytest.raises(QuantizeError, match=r"multiple of 32, got \[16, 40\]"):
        Q4Weight.from_blocks(torch.zeros(16, 40, dtype=torch.uint8), d, d)
    with pytest.raises(QuantizeError, match="0..15, got one of 16"):
        Q4Weight.from_blocks(q.clone().fill_(16), d, d)
    with pytest.raises(QuantizeError, match="uint8 .out, in., got torch.int8"):
        Q4Weight.from_blocks(q.to(torch.int8), d, d)
    with pytest.raises(QuantizeError, match=r"d must be .* of shape \[16, 2\].*got torch.float32 \[16, 3\]"):
        Q4Weight.from_blocks(q, torch.ones(16, 3), d)
    with pytest.raises(QuantizeError, match="m must be float32, float16 or bfloat16.*got torch.float64"):
        Q4Weight.from_blocks(q, d, d.double())
    with pytest.raises(QuantizeError, match="m hold a value that is not finite"):
        Q4Weight.from_blocks(q, d, d.clone().fill_(float("inf")))
    packed = Q4Weight.from_blocks(q, d, d)
    with pytest.raises(ValueError, match=r"a \[T, 64\] input expected by a \[16, 64\] weight, got \[2, 32\]"):
        packed(torch.ones(2, 32))
    with pytest.raises(ValueError, match="unknown path 'sse'"):
        packed(torch.ones(2, 64), path="sse")

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
    scales = torch.full((shape[0], shape[1] // BLOCK), 0.01, dtype=torch.float16)
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
    if {"avx2", "fma", "f16c"} <= flags:
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
    # The 4-bit weight is the float one within half a step of its block, the step a little wider for
    # the float16 scales rounded outwards: m down by at most |min| 2^-11, d up by at most 2^-10.
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    low = blocks.amin(dim=-1)
    step = ((blocks.amax(dim=-1) - low) / 15 + low.abs() * 2**-11 / 15) * (1 + 2**-10)
    gap = (packed.dequantize() - weight).abs().view_as(blocks).amax(dim=-1)
    assert (gap <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert (gap > 0).any()


def test_quantized_scales_are_float16_and_the_values_are_rounded_against_them():
    weight, _ = weight_and_rows()
    weight[0, :BLOCK] = torch.linspace(-1, 2, BLOCK) / 3  # a block whose ends float16 does not hold
    packed = Q4Weight(weight)
    q, d, m = packed.blocks()
    assert d.dtype == m.dtype == torch.float16 and q.dtype == torch.uint8
    # q is the nearest step against the stored d and m, not against the unrounded ones.
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    expected = ((blocks - m.float()[..., None]) / d.float()[..., None]).round().clamp(0, 15)
    assert torch.equal(q.view_as(blocks).float(), expected)
    assert torch.equal(
        packed.dequantize(), (q.view_as(blocks) * d.float()[..., None] + m.float()[..., None]).view_as(weight)
    )
    # Its blocks packed again are the same weight: nothing but q, d and m is stored.
    again = Q4Weight.from_blocks(q, d, m)
    assert torch.equal(again._packed, packed._packed)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blocks_come_back_exactly_as_d_times_q_plus_m(scale_dtype):
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (40, 128), generator=gen, dtype=torch.uint8)
    # Scales on a grid both float16 and bfloat16 hold (7 significant bits), as a converted GGUF's are.
    d = (torch.randint(1, 128, (40, 4), generator=gen) / 1024).to(scale_dtype)
    minimums = (torch.randint(-127, 128, (40, 4), generator=gen) / 512).to(scale_dtype)
    for m in (minimums, -8 * d):  # Q4_1, then Q4_0
        packed = Q4Weight.from_blocks(q, d, m)
        expected = q.float().view(40, 4, BLOCK) * d.float()[..., None] + m.float()[..., None]
        assert torch.equal(packed.dequantize(), expected.view(40, 128))
        assert [t.dtype for t in packed.blocks()] == [torch.uint8, torch.float16, torch.float16]
    # Half a byte a weight, and an eighth for the float16 block scales, as a Q4_1 GGUF.
    assert packed.nbytes == 48 * 128 * 5 // 8  # 40 outputs padded to 3 groups of 16
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
    # Scales that float16 does not hold would be rounded a second time: refused, not rounded.
    with pytest.raises(QuantizeError, match=r"d must be exact in float16 .*d\[3, 1\] = 0.1000000\d* is not"):
        Q4Weight.from_blocks(
            q, d.clone().index_put_((torch.tensor(3), torch.tensor(1)), torch.tensor(0.1)), d
        )
    with pytest.raises(
        QuantizeError, match=r"m must be exact in float16 .*m\[0, 0\] = 1.0000000\d*e-07 is not"
    ):
        Q4Weight.from_blocks(q, d, torch.full((16, 2), 1e-7))  # below float16's least subnormal step
    with pytest.raises(QuantizeError, match="m must be exact in float16"):
        Q4Weight.from_blocks(q, d, torch.full((16, 2), 3.0e5).to(torch.bfloat16))
    with pytest.raises(QuantizeError, match=r"block scales within float16's range .* got a block scale of"):
        Q4Weight(torch.full((16, 64), -1e6))
    packed = Q4Weight.from_blocks(q, d, d)
    with pytest.raises(ValueError, match=r"a \[T, 64\] input expected by a \[16, 64\] weight, got \[2, 32\]"):
        packed(torch.ones(2, 32))
    with pytest.raises(ValueError, match="unknown path 'sse'"):
        packed(torch.ones(2, 64), path="sse")

"""4-bit weights (tpserve/kernels/q4_linear.py): extreme blocks give every path the same bits, the weight is
near the float one, packed blocks come back exactly, and bad input is refused by name. What both block weights
promise alike (batch invariance, the paths agreeing, the product) is test_block_weights.py's."""

from __future__ import annotations

import pytest
import torch
from block_cases import SHAPES, weight_and_rows

from tpserve.kernels.int8_linear import QuantizeError
from tpserve.kernels.q4_linear import BLOCK, Q4Weight, q4_available, supported_paths

pytestmark = pytest.mark.skipif(q4_available() is not None, reason=str(q4_available()))


@pytest.mark.parametrize("shape", SHAPES)
def test_extreme_blocks_give_every_path_the_scalar_paths_bits(shape):
    # Every nibble 15 against inputs at +-absmax (the largest int16 pair sums on AVX2).
    q = torch.full(shape, 15, dtype=torch.uint8)
    scales = torch.full((shape[0], shape[1] // BLOCK), 0.01, dtype=torch.float16)
    extreme = Q4Weight.from_blocks(q, scales, -scales)
    signs = torch.tensor([1.0, -1.0]).repeat(shape[1] // 2)
    for x in (torch.ones(3, shape[1]), -torch.ones(3, shape[1]), signs.expand(3, -1)):
        for path in supported_paths():
            assert torch.equal(extreme(x, path=path), extreme(x, path="scalar")), path


def test_the_weight_is_the_float_one_within_half_a_step_of_its_block():
    weight, _ = weight_and_rows()
    packed = Q4Weight(weight)
    # Half a step, the step a little wider for the float16 scales rounded outwards: m down by at most
    # |min| 2^-11, d up by at most 2^-10.
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
    with pytest.raises(QuantizeError, match=r"block scales within float16's range .* got a block scale of"):
        Q4Weight(torch.full((16, 64), -1e6))


@pytest.mark.parametrize(
    "d_value, m_value",
    [(0.1, 1.0), (1.0, 1e-7), (1.0, 3.0e5), (65504.0 * 63, -1.0)],
    ids=["d-inexact", "m-below-subnormals", "m-past-range", "q4k-scale-past-range"],
)
def test_scales_float16_does_not_hold_are_kept_in_float32_not_rounded(d_value, m_value):
    # GGUF's Q4_K gives d * sc and -dmin * mn per block: exact in float32, often not in float16.
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (20, 64), generator=gen, dtype=torch.uint8)
    d, m = torch.ones(20, 2), torch.zeros(20, 2)
    d[3, 1], m[7, 0] = d_value, m_value
    packed = Q4Weight.from_blocks(q, d, m)
    assert packed.scale_dtype == torch.float32
    got_q, got_d, got_m = packed.blocks()
    assert torch.equal(got_q, q) and torch.equal(got_d, d) and torch.equal(got_m, m)
    expected = q.float().view(20, 2, BLOCK) * d[..., None] + m[..., None]
    assert torch.equal(packed.dequantize(), expected.view(20, 64))
    # 0.75 bytes a weight: the nibbles, then d and m in float32 per block of 32.
    assert packed.nbytes == 32 * 64 * 3 // 4  # 20 outputs padded to 2 groups of 16


def test_float16_scales_give_the_same_bits_in_the_float32_layout():
    # The float32 layout changes how the scales are loaded, never the arithmetic: the same values in
    # either layout give the same products on every path, at any batch.
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (100, 96), generator=gen, dtype=torch.uint8)
    d = (torch.rand(100, 3, generator=gen) / 64).to(torch.float16)
    m = (-torch.rand(100, 3, generator=gen) / 8).to(torch.float16)
    half = Q4Weight.from_blocks(q, d, m)
    wide = Q4Weight.__new__(Q4Weight)
    wide._pack(q, d.float(), m.float())
    assert half.scale_dtype == torch.float16 and wide.scale_dtype == torch.float32
    assert wide.nbytes == half.nbytes * 6 // 5
    _, rows = weight_and_rows(100, 96, num_rows=19)
    for path in ["auto", *supported_paths()]:
        for num_rows in (1, 4, 16, 19):
            assert torch.equal(wide(rows[:num_rows], path=path), half(rows[:num_rows], path=path)), path

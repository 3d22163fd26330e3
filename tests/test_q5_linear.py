"""5-bit weights (tpserve/kernels/q5_linear.py): extreme blocks give every path the same bits, packed blocks
come back exactly as d * q + m in either scale layout, and bad input is refused by name. What every block
weight promises alike (batch invariance, the paths agreeing, the product) is test_block_weights.py's."""

from __future__ import annotations

import pytest
import torch
from block_cases import SHAPES, weight_and_rows

from tpserve.kernels.block_weights import BLOCK
from tpserve.kernels.int8_linear import QuantizeError
from tpserve.kernels.q5_linear import KERNEL, Q5Weight, q5_available

pytestmark = pytest.mark.skipif(q5_available() is not None, reason=str(q5_available()))


@pytest.mark.parametrize("shape", SHAPES)
def test_extreme_blocks_give_every_path_the_scalar_paths_bits(shape):
    # Every value 31 against inputs at +-absmax: AVX2's int16 sums of 2 chunks reach 31496.
    q = torch.full(shape, 31, dtype=torch.uint8)
    scales = torch.full((shape[0], shape[1] // BLOCK), 0.01, dtype=torch.float16)
    extreme = Q5Weight.from_blocks(q, scales, -16 * scales)
    signs = torch.tensor([1.0, -1.0]).repeat(shape[1] // 2)
    for x in (torch.ones(3, shape[1]), -torch.ones(3, shape[1]), signs.expand(3, -1)):
        for path in KERNEL.supported_paths():
            assert torch.equal(extreme(x, path=path), extreme(x, path="scalar")), path


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_blocks_come_back_exactly_and_float16_scales_give_the_same_bits_in_the_float32_layout(scale_dtype):
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 32, (100, 96), generator=gen, dtype=torch.uint8)
    d = (torch.rand(100, 3, generator=gen) / 64).to(torch.float16)
    m = (-torch.rand(100, 3, generator=gen) / 8).to(torch.float16)
    packed = Q5Weight.from_blocks(q, d.to(scale_dtype), m.to(scale_dtype))
    assert packed.scale_dtype == torch.float16  # float16 holds them: the narrower layout
    got_q, got_d, got_m = packed.blocks()
    assert torch.equal(got_q, q) and torch.equal(got_d, d) and torch.equal(got_m, m)
    expected = q.float().view(100, 3, BLOCK) * d.float()[..., None] + m.float()[..., None]
    assert torch.equal(packed.dequantize(), expected.view(100, 96))
    assert packed.nbytes == 112 * 96 * 3 // 4  # 5 bits a value, 4 bytes of float16 d and m per 32
    wide = Q5Weight.__new__(Q5Weight)
    wide._pack(q, d.float(), m.float())
    assert wide.scale_dtype == torch.float32 and wide.nbytes == 112 * 96 * 7 // 8
    _, rows = weight_and_rows(100, 96, num_rows=19)
    for path in ["auto", *KERNEL.supported_paths()]:
        assert torch.equal(wide(rows, path=path), packed(rows, path=path)), path


def test_bad_input_is_refused_by_name():
    q = torch.zeros(16, 64, dtype=torch.uint8)
    d = torch.ones(16, 2)
    with pytest.raises(QuantizeError, match="5-bit values must lie in 0..31, got one of 32"):
        Q5Weight.from_blocks(q.clone().fill_(32), d, d)
    with pytest.raises(QuantizeError, match=r"5-bit values must be uint8 .out, in., got torch.int8"):
        Q5Weight.from_blocks(q.to(torch.int8), d, d)
    with pytest.raises(QuantizeError, match="m hold a value that is not finite"):
        Q5Weight.from_blocks(q, d, d.clone().fill_(float("nan")))

"""MXFP4 weights (tpserve/kernels/mxfp4_linear.py): blocks of every code at scales near both ends of e8m0
give every path the scalar path's bits, a checkpoint's blocks come back as stored and multiply near the
float64 product of their exact values, and bad input is refused by name. What every block weight
promises alike (batch invariance, the paths agreeing on random weights, the product) is
test_block_weights.py's."""

from __future__ import annotations

import pytest
import torch
from block_cases import SHAPES
from mxfp4_models import encode_mxfp4

from tpserve.kernels.block_weights import BLOCK
from tpserve.kernels.int8_linear import QuantizeError
from tpserve.kernels.mxfp4_linear import KERNEL, Mxfp4Weight, mxfp4_available
from tpserve.ranks.mxfp4 import dequantize_mxfp4

pytestmark = pytest.mark.skipif(mxfp4_available() is not None, reason=str(mxfp4_available()))

# 2^-127 and 2^-126 (subnormal and least normal d * 2), 2^0, and the largest scales
SCALES = (0, 1, 2, 127, 200, 254)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, infinities and NaNs included."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def hf_blocks(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] -> the checkpoints' blocks [out, in / 32, 16]: the even element's code low."""
    pairs = codes.view(codes.shape[0], -1, BLOCK // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_extreme_blocks_give_every_path_the_scalar_paths_bits(shape, scale):
    num_out, num_in = shape
    every_code = torch.arange(16, dtype=torch.uint8).repeat(num_out, num_in // 16)
    scales = torch.full((num_out, num_in // BLOCK), scale, dtype=torch.uint8)
    # every code 7 (6, looked up as 24 on the vector paths) against +-absmax: AVX2's int16 sums of 2
    # chunks reach 4 * 2 * 24 * 127 = 24384
    weights = [Mxfp4Weight.from_blocks(every_code, scales)]
    weights.append(Mxfp4Weight.from_blocks(torch.full(shape, 7, dtype=torch.uint8), scales))
    signs = torch.tensor([1.0, -1.0]).repeat(num_in // 2)
    rows = [torch.ones(5, num_in), -torch.ones(5, num_in), signs.expand(5, -1), torch.randn(5, num_in)]
    for weight in weights:
        for x in rows:
            for size in (1.0, 2.0**-100):  # the largest scales' products finite, or infinite
                scalar = weight(x * size, path="scalar")
                for path in KERNEL.supported_paths():
                    assert same_bits(weight(x * size, path=path), scalar), (path, scale)


def test_subnormal_and_huge_scales_give_exact_products():
    # one block, every code 2 (1.0): the product is d * da * dot, its one rounding that of d * da
    codes = torch.full((16, BLOCK), 2, dtype=torch.uint8)
    x = torch.ones(1, BLOCK)  # qa = 127, da = 1 / 127: dot = 2 * 127 * 32
    for scale in (0, 1, 127, 254):
        weight = Mxfp4Weight.from_blocks(codes, torch.full((16, 1), scale, dtype=torch.uint8))
        d = torch.tensor(2.0 ** (scale - 128), dtype=torch.float32)
        expected = torch.full((1, 16), float(d * torch.tensor(1 / 127, dtype=torch.float32))) * (2 * 127 * 32)
        for path in KERNEL.supported_paths():
            assert same_bits(weight(x, path=path), expected.float()), (path, scale)


def test_a_checkpoints_blocks_come_back_as_stored_and_multiply_near_their_float64_product():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(100, 2 * 96, generator=gen) * torch.rand(100, 1, generator=gen)
    blocks, scales, decoded = encode_mxfp4(weight)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).view(100, -1)
    packed = Mxfp4Weight.from_blocks(codes, scales)
    got_codes, got_scales = packed.blocks()
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    assert torch.equal(hf_blocks(got_codes), blocks)
    exact = dequantize_mxfp4(blocks, scales, torch.float32, "test")
    assert torch.equal(packed.dequantize(), exact) and torch.equal(exact, decoded)
    # 17 bytes per 32 weights, the outputs padded to whole groups of 16
    assert packed.nbytes == 112 * (2 * 96 // BLOCK) * 17
    rows = torch.randn(20, 2 * 96, generator=gen) * 3
    reference = rows.double() @ exact.double().t()
    for path in KERNEL.supported_paths():
        error = (packed(rows, path=path).double() - reference).norm() / reference.norm()
        assert 0 < error < 0.01, (path, float(error))  # the inputs' 8-bit rounding only


def test_a_float_weight_is_quantized_to_its_nearest_values_under_a_scale_that_covers_its_block():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(32, 64, generator=gen)
    weight[1, :BLOCK] = 0  # a block of zeros: the least scale, every code 0
    blocks, scales, decoded = encode_mxfp4(weight)
    packed = Mxfp4Weight(weight)
    codes, got_scales = packed.blocks()
    assert torch.equal(got_scales[0], scales[0]) and got_scales[1, 0] == 0
    assert torch.equal(packed.dequantize()[2:], decoded[2:])


def test_bad_input_is_refused_by_name():
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    scales = torch.full((16, 2), 127, dtype=torch.uint8)
    with pytest.raises(QuantizeError, match="MXFP4 codes must lie in 0..15, got one of 16"):
        Mxfp4Weight.from_blocks(codes.clone().fill_(16), scales)
    with pytest.raises(QuantizeError, match=r"MXFP4 codes must be uint8 .out, in., got torch.int8"):
        Mxfp4Weight.from_blocks(codes.to(torch.int8), scales)
    with pytest.raises(QuantizeError, match=r"MXFP4 scales must be uint8 \[16, 2\] for codes \[16, 64\]"):
        Mxfp4Weight.from_blocks(codes, scales.float())
    with pytest.raises(
        QuantizeError, match=r"MXFP4 scales must be uint8 \[16, 2\] .*got torch.uint8 \[16, 1\]"
    ):
        Mxfp4Weight.from_blocks(codes, scales[:, :1])
    with pytest.raises(QuantizeError, match=r"an MXFP4 scale is NaN \(255\)"):
        Mxfp4Weight.from_blocks(codes, scales.clone().fill_(255))
    with pytest.raises(QuantizeError, match="MXFP4 weights must be finite"):
        Mxfp4Weight(torch.full((16, 64), float("inf")))

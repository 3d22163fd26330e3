"""The GPU's quantized weights, built here as they are on a GPU and run through the CPU twins of
torch's kernels: 4-bit blocks packed for `_weight_int4pack_mm` (tpserve/kernels/int4pack_linear.py) give the
dequantized weight's product, and fp8 weights through `_scaled_mm` (tpserve/kernels/fp8_linear.py) the
product of their stored values and scales, each within its rounding."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels.fp8_linear import FP8, Fp8Weight, fp8_unfit, quantize_rows
from tpserve.kernels.int4pack_linear import (
    Int4PackWeight,
    inner_k_tiles,
    int4pack_unfit,
    nibble_pairs,
    scales_and_zeros,
)
from tpserve.kernels.int8_linear import QuantizeError
from tpserve.ranks.block_tensors import BlockValues


def blocks(num_out: int, num_in: int, seed: int = 0) -> BlockValues:
    """Random 4-bit blocks as a GPTQ checkpoint gives them: d > 0, m = -z * d with an integer z."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (num_out, num_in), generator=gen, dtype=torch.uint8)
    d = (torch.rand(num_out, num_in // 32, generator=gen) * 0.02 + 0.001).to(torch.float16)
    z = torch.randint(0, 16, d.shape, generator=gen).float()
    return BlockValues(q, d, -z * d.float())


@pytest.mark.parametrize("shape", [(64, 256), (48, 96), (16, 32)])
def test_int4_packed_for_torchs_product_gives_the_dequantized_weights_product(shape):
    weight = blocks(*shape)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(1))
    expected = x.double() @ weight.dequantize().double().T
    exact = Int4PackWeight.from_blocks(weight.q, weight.d, weight.m, torch.float32)
    assert exact(x).dtype == torch.float32
    torch.testing.assert_close(exact(x).double(), expected, rtol=1e-5, atol=1e-4)
    # bfloat16, as the GPU serves it: rows, scales and zeros rounded to 8 significant bits
    served = Int4PackWeight.from_blocks(weight.q, weight.d, weight.m)
    scale = expected.abs().max().item()
    assert (served(x).double() - expected).abs().max().item() < 0.03 * scale
    assert served.nbytes < weight.q.numel()  # about 4 bits a weight, not 16


def test_int4_pack_inputs_as_the_cuda_converter_reads_them():
    weight = blocks(8, 64)
    pairs = nibble_pairs(weight.q)
    assert pairs.shape == (8, 32) and pairs.dtype == torch.uint8
    assert torch.equal(pairs >> 4, weight.q[:, ::2]) and torch.equal(pairs & 15, weight.q[:, 1::2])
    # one group: (q - 8) * scale + zero is d * q + m
    packed = scales_and_zeros(weight.d, weight.m, torch.float32)
    assert packed.shape == (2, 8, 2)
    rebuilt = (weight.q[:, :32].float() - 8) * packed[0, :, 0:1] + packed[0, :, 1:2]
    torch.testing.assert_close(rebuilt, weight.dequantize()[:, :32])
    assert [inner_k_tiles(n) for n in (256, 64, 32, 48)] == [8, 4, 2, None]
    assert int4pack_unfit(12, 256, "cuda") and int4pack_unfit(16, 48, "cpu")
    assert int4pack_unfit(16, 256, "cuda") is None
    with pytest.raises(QuantizeError, match="tiles of 32"):
        # 48 inputs: whole groups of 16, not of 32
        Int4PackWeight.from_blocks(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1))


def test_fp8_through_scaled_mm_gives_the_stored_weights_product():
    gen = torch.Generator().manual_seed(2)
    values = (torch.randn(32, 64, generator=gen) * 50).to(FP8)
    scales = torch.rand(32, generator=gen) * 0.01 + 0.001
    weight = Fp8Weight(values, scales, torch.float32)
    x = torch.randn(7, 64, generator=gen)
    expected = x.double() @ weight.dequantize().double().T
    # the rows go in fp8 too (3 significand bits): each product term off by at most 2^-4 relative
    bound = (x.abs().double() @ weight.dequantize().abs().double().T) * 2**-4
    assert ((weight(x).double() - expected).abs() <= bound + 1e-6).all()
    assert weight(x).shape == (7, 32)
    # a row's quantization is its own: the same fp8 values and scale alone as beside others
    alone, batch = quantize_rows(x[2:3]), quantize_rows(x)
    assert torch.equal(alone[0].float(), batch[0][2:3].float()) and torch.equal(alone[1], batch[1][2:3])
    one_scale = Fp8Weight(values, torch.tensor([0.004]), torch.float32)
    torch.testing.assert_close(one_scale.dequantize(), values.float() * 0.004)


def test_fp8_rows_scale_by_their_own_absmax_and_refuse_what_cuda_cannot_take():
    rows, scales = quantize_rows(torch.tensor([[1.0, -448.0 * 3], [0.0, 0.0]]))
    assert rows.dtype == FP8 and scales[:, 0].tolist() == [3.0, 1.0]
    assert rows.float()[0, 1].item() == -448.0
    assert fp8_unfit(24, 64, "cuda") and fp8_unfit(24, 64, "cpu") is None
    with pytest.raises(QuantizeError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(16, 16), torch.ones(16))

"""8-bit block weights (tpserve/kernels/q8_linear.py): extreme blocks give every path the exact product, the
weight is near the float one, checkpoint blocks come back exactly, the embedding rows are the head's
own, and bad input is refused by name. What both block weights promise alike (batch invariance, the
paths agreeing, the product) is test_block_weights.py's."""

from __future__ import annotations

import pytest
import torch
from block_cases import SHAPES, weight_and_rows

from tpserve.kernels import q4_linear
from tpserve.kernels.int8_linear import QuantizeError
from tpserve.kernels.q8_linear import BLOCK, Q8Weight, q8_available, supported_paths

pytestmark = pytest.mark.skipif(q8_available() is not None, reason=str(q8_available()))


@pytest.mark.parametrize("shape", SHAPES)
def test_extreme_blocks_give_every_path_the_exact_product(shape):
    # Extreme blocks against inputs at +-absmax: -128 gives AVX2 its largest int16 pairs (2 * 128 * 127),
    # 127 gives VNNI its largest u8 (q + 128 = 255). The exact products are known.
    d = torch.full((shape[0], shape[1] // BLOCK), 2.0**-7, dtype=torch.float16)
    signs = torch.tensor([1.0, -1.0]).repeat(shape[1] // 2)
    for value in (-128, 127, -127):
        extreme = Q8Weight.from_blocks(torch.full(shape, value, dtype=torch.int8), d)
        for x in (torch.ones(3, shape[1]), -torch.ones(3, shape[1]), signs.expand(3, -1)):
            for path in supported_paths():
                got = extreme(x, path=path)
                assert torch.equal(got, extreme(x, path="scalar")), path
                # x quantizes to +-127 at da = 1 / 127: each input adds d * value * 127 * da * sign.
                expected = value * 2.0**-7 * x.sum(dim=1, keepdim=True)
                assert torch.allclose(got, expected.expand_as(got), rtol=1e-6), path


def test_the_kernel_runs_the_same_paths_as_the_4_bit_one():
    # One header (block_quantize.h) decides both; test_block_weights.py checks them against /proc/cpuinfo.
    assert supported_paths() == q4_linear.supported_paths()


def test_the_weight_is_the_float_one_within_half_a_step_of_its_block():
    weight, _ = weight_and_rows()
    packed = Q8Weight(weight)
    # d = absmax / 127 rounded up to float16 (at most 2^-10 relative).
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    step = blocks.abs().amax(dim=-1) / 127 * (1 + 2**-10)
    gap = (packed.dequantize() - weight).abs().view_as(blocks).amax(dim=-1)
    assert (gap <= step / 2 * (1 + 1e-5) + 1e-9).all()
    assert (gap > 0).any()


def test_quantized_scales_are_float16_and_the_values_are_rounded_against_them():
    weight, _ = weight_and_rows()
    weight[0, :BLOCK] = torch.linspace(-1, 1, BLOCK) / 3  # absmax / 127 is not a float16
    packed = Q8Weight(weight)
    q, d = packed.blocks()
    assert q.dtype == torch.int8 and d.dtype == torch.float16
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    assert torch.equal(q.view_as(blocks).float(), (blocks / d.float()[..., None]).round())
    assert int(q.abs().max()) == 127  # d rounded up: the largest value still reaches 127, no further
    assert torch.equal(Q8Weight.from_blocks(q, d)._packed, packed._packed)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_checkpoint_blocks_come_back_exactly_as_d_times_q(scale_dtype):
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (40, 128), generator=gen, dtype=torch.int8)
    q[0, 0], q[1, 1] = -128, 127  # Q8_0's full range
    # Scales on a grid both float16 and bfloat16 hold (7 significant bits), as a converted GGUF's are.
    d = (torch.randint(1, 128, (40, 4), generator=gen) / 2**14).to(scale_dtype)
    packed = Q8Weight.from_blocks(q, d)
    expected = q.float().view(40, 4, BLOCK) * d.float()[..., None]
    assert torch.equal(packed.dequantize(), expected.view(40, 128))
    got_q, got_d = packed.blocks()
    assert torch.equal(got_q, q) and torch.equal(got_d.float(), d.float())
    # A wider integer type holding the same values packs the same weight.
    assert torch.equal(Q8Weight.from_blocks(q.to(torch.int32), d)._packed, packed._packed)
    # One byte a weight and two for each block's float16 scale: Q8_0's 34 bytes per 32 weights.
    assert packed.nbytes == 48 * 128 * 34 // 32  # 40 outputs padded to 3 groups of 16
    assert packed.shape == (40, 128) and packed.dtype == torch.float32


def test_embedding_rows_are_the_dequantized_weights_rows():
    weight, _ = weight_and_rows(num_out=100, num_in=96)
    packed = Q8Weight(weight)
    full = packed.dequantize()
    gen = torch.Generator().manual_seed(3)
    for ids in (
        torch.tensor([0]),
        torch.tensor([99, 15, 16, 17, 15]),  # group edges, the last part-group, a repeat
        torch.randint(0, 100, (512,), generator=gen),
        torch.zeros(0, dtype=torch.long),
    ):
        rows = packed.rows(ids)
        assert rows.shape == (len(ids), 96) and rows.dtype == torch.float32
        assert torch.equal(rows, full[ids])
    # From a checkpoint's blocks: exactly d * q, the product's own weight.
    q = torch.randint(-128, 128, (20, 64), generator=gen, dtype=torch.int8)
    d = torch.rand(20, 2, generator=gen).half()
    ids = torch.tensor([19, 3])
    assert torch.equal(
        Q8Weight.from_blocks(q, d).rows(ids),
        (q.float().view(20, 2, BLOCK) * d.float()[..., None]).view(20, 64)[ids],
    )


def test_bad_input_is_refused_by_name():
    q = torch.zeros(16, 64, dtype=torch.int8)
    d = torch.ones(16, 2)
    with pytest.raises(QuantizeError, match=r"multiple of 32, got \[16, 40\]"):
        Q8Weight.from_blocks(torch.zeros(16, 40, dtype=torch.int8), d)
    with pytest.raises(QuantizeError, match=r"signed integers \(int8\) \[out, in\], got torch.uint8"):
        Q8Weight.from_blocks(q.to(torch.uint8), d)  # bytes 128..255 would read as other values
    with pytest.raises(QuantizeError, match=r"signed integers \(int8\) \[out, in\], got torch.float32"):
        Q8Weight.from_blocks(q.float(), d)
    with pytest.raises(QuantizeError, match=r"-128..127, got -129..0"):
        Q8Weight.from_blocks(q.to(torch.int16).index_fill_(1, torch.tensor([5]), -129), d)
    with pytest.raises(QuantizeError, match=r"-128..127, got 0..128"):
        Q8Weight.from_blocks(q.to(torch.int32).index_fill_(1, torch.tensor([5]), 128), d)
    with pytest.raises(QuantizeError, match=r"d must be .* of shape \[16, 2\].*got torch.float32 \[16, 3\]"):
        Q8Weight.from_blocks(q, torch.ones(16, 3))
    with pytest.raises(QuantizeError, match="d must be float32, float16 or bfloat16.*got torch.float64"):
        Q8Weight.from_blocks(q, d.double())
    with pytest.raises(QuantizeError, match="d hold a value that is not finite"):
        Q8Weight.from_blocks(q, d.clone().fill_(float("nan")))
    with pytest.raises(QuantizeError, match=r"d must be exact in float16 .*d\[0, 0\] = 0.1000000\d* is not"):
        Q8Weight.from_blocks(q, torch.full((16, 2), 0.1))
    with pytest.raises(QuantizeError, match=r"block scales within float16's range"):
        Q8Weight(torch.full((16, 64), 1e7))
    packed = Q8Weight.from_blocks(q, d)
    with pytest.raises(ValueError, match=r"row ids must lie in 0..15 for a \[16, 64\] weight, got 0..16"):
        packed.rows(torch.tensor([0, 16]))
    with pytest.raises(ValueError, match=r"row ids must lie in 0..15 .*got -1..3"):
        packed.rows(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match=r"row ids must be int64 \[n\], got torch.int32 \[2\]"):
        packed.rows(torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"row ids must be int64 \[n\], got torch.int64 \[1, 2\]"):
        packed.rows(torch.tensor([[0, 1]]))

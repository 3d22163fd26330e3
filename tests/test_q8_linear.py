"""8-bit block weights (kernels/q8_linear.py): a row is the same at any batch and on every code path,
near the float product, checkpoint blocks come back exactly, the embedding rows are the head's own,
and bad input is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.kernels import q4_linear
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError
from tpserve.kernels.q8_linear import BLOCK, Q8Weight, q8_available, supported_paths

pytestmark = pytest.mark.skipif(q8_available() is not None, reason=str(q8_available()))

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
    packed = Q8Weight(weight)
    alone = torch.cat([packed(rows[i : i + 1], path=path) for i in range(len(rows))])
    for num_rows in range(1, 65):
        assert torch.equal(packed(rows[:num_rows], path=path), alone[:num_rows]), f"{num_rows} rows"
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
    assert torch.equal(packed(rows[order], path=path), alone[order])
    assert torch.equal(packed(rows[10:11].expand(9, -1), path=path), alone[10:11].expand(9, -1))


@pytest.mark.parametrize("shape", SHAPES)
def test_every_path_this_cpu_runs_gives_the_scalar_paths_bits(shape):
    weight, rows = weight_and_rows(*shape, num_rows=67)
    packed = Q8Weight(weight)
    for num_rows in (1, 2, 3, 4, 5, 7, 16, 67):
        scalar = packed(rows[:num_rows], path="scalar")
        for path in supported_paths():
            assert torch.equal(packed(rows[:num_rows], path=path), scalar), f"{path}, {num_rows} rows"
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
    # One header (block_quantize.h) decides both; the 4-bit test checks them against /proc/cpuinfo.
    assert supported_paths() == q4_linear.supported_paths()


def emulated(weight: Q8Weight, rows: torch.Tensor) -> torch.Tensor:
    """The same quantized operands multiplied in float64: what the kernel computes, less its float32
    rounding."""
    blocks = rows.view(rows.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(scale > 0, blocks / scale.clamp_min(1e-30), 0).clamp(-127, 127).round()
    return (codes.double() * scale.double()).view_as(rows) @ weight.dequantize().double().t()


def test_the_product_is_its_quantized_operands_product_and_near_the_float_one():
    weight, rows = weight_and_rows()
    packed = Q8Weight(weight)
    assert isinstance(packed, PackedWeight)  # kernels/linear.py's linear() dispatches on it
    bias = torch.randn(weight.shape[0])
    got = packed(rows, bias)
    assert got.shape == (len(rows), weight.shape[0]) and got.dtype == torch.float32
    assert torch.equal(got[3], bias), "a row of zeros gives the bias alone"
    got = got - bias
    # Against the exact product of the very operands: float32 rounding of the per-block epilogue only
    # (3 blocks, each an exact integer times d * da, summed in float32: a few 1e-7 relative).
    exact = emulated(packed, rows)
    assert ((got.double() - exact).norm() / exact.norm()) < 1e-5
    # Against the float product with the 8-bit weight: the input's 8-bit rounding only. A block rounds
    # to steps of absmax / 127 with an error of rms step / sqrt(12); a block of 32 Gaussian values has
    # absmax about 2-2.5 sigma, so the relative error of a row is about 2.5 / (127 * 3.46) = 0.6%.
    reference = F.linear(rows, packed.dequantize())
    error = (got - reference).norm() / reference.norm()
    assert 0 < error < 0.01, f"relative error {error:.4f}"
    # The 8-bit weight is the float one within half a step of its block, d = absmax / 127 rounded up
    # to float16 (at most 2^-10 relative).
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
    with pytest.raises(QuantizeError, match=r"8-bit weights need .* multiple of 32, got \[16, 48\]"):
        Q8Weight(torch.randn(16, 48))
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
    with pytest.raises(ValueError, match=r"a \[T, 64\] input expected by a \[16, 64\] weight, got \[2, 32\]"):
        packed(torch.ones(2, 32))
    with pytest.raises(ValueError, match="unknown path 'sse'"):
        packed(torch.ones(2, 64), path="sse")
    with pytest.raises(ValueError, match=r"row ids must lie in 0..15 for a \[16, 64\] weight, got 0..16"):
        packed.rows(torch.tensor([0, 16]))
    with pytest.raises(ValueError, match=r"row ids must lie in 0..15 .*got -1..3"):
        packed.rows(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match=r"row ids must be int64 \[n\], got torch.int32 \[2\]"):
        packed.rows(torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"row ids must be int64 \[n\], got torch.int64 \[1, 2\]"):
        packed.rows(torch.tensor([[0, 1]]))

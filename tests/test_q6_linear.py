"""6-bit weights (tpserve/kernels/q6_linear.py): extreme blocks give every path the same bits, packed blocks
come back exactly as d * sc * (q - 32), a tied embedding's rows are dequantize()'s, and bad input is refused
by name. What every block weight promises alike (batch invariance, the paths agreeing, the product) is
test_block_weights.py's."""

from __future__ import annotations

import pytest
import torch
from block_cases import SHAPES

from tpserve.kernels.block_weights import BLOCK
from tpserve.kernels.int8_linear import QuantizeError
from tpserve.kernels.q6_linear import KERNEL, Q6Weight, q6_available

pytestmark = pytest.mark.skipif(q6_available() is not None, reason=str(q6_available()))


def random_blocks(num_out: int, num_in: int, seed: int = 2):
    """Random valid Q6_K-like blocks: q 0..63, every int8 sub-scale, float16 d of either sign."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (num_out, num_in), generator=gen, dtype=torch.uint8)
    sc = torch.randint(-128, 128, (num_out, num_in // 16), generator=gen, dtype=torch.int8)
    d = ((torch.rand(num_out, num_in // BLOCK, generator=gen) - 0.5) / 1024).to(torch.float16)
    return q, sc, d


@pytest.mark.parametrize("shape", SHAPES)
def test_extreme_blocks_give_every_path_the_scalar_paths_bits(shape):
    # The largest exact integer a block can reach: q - 32 = -32 against -127 with sc -128 in both
    # halves is 16646144, just under 2^24; and q - 32 = 31 with sc 127.
    num_out, num_in = shape
    for value, scale in ((0, -128), (63, 127), (0, 127)):
        q = torch.full(shape, value, dtype=torch.uint8)
        sc = torch.full((num_out, num_in // 16), scale, dtype=torch.int8)
        extreme = Q6Weight.from_blocks(q, sc, torch.full((num_out, num_in // BLOCK), 0.01).half())
        signs = torch.tensor([1.0, -1.0]).repeat(num_in // 2)
        for x in (torch.ones(3, num_in), -torch.ones(3, num_in), signs.expand(3, -1)):
            for path in KERNEL.supported_paths():
                assert torch.equal(extreme(x, path=path), extreme(x, path="scalar")), (value, scale, path)


def test_blocks_come_back_exactly_as_d_times_sc_times_q_minus_32():
    q, sc, d = random_blocks(40, 128)
    packed = Q6Weight.from_blocks(q, sc, d.float())  # float32 scales float16 holds are taken
    got_q, got_sc, got_d = packed.blocks()
    assert torch.equal(got_q, q) and torch.equal(got_sc, sc) and torch.equal(got_d, d)
    step = d.float().repeat_interleave(2, dim=1) * sc.float()
    expected = (q.float().view(40, 8, 16) - 32) * step[..., None]
    assert torch.equal(packed.dequantize(), expected.view(40, 128))
    assert torch.equal(Q6Weight.from_blocks(got_q, got_sc, got_d)._packed, packed._packed)
    # 6 bits a value, 2 bytes of sub-scales and 2 of d per 32: 0.875 bytes a weight.
    assert packed.nbytes == 48 * 128 * 7 // 8  # 40 outputs padded to 3 groups of 16


def test_rows_are_the_dequantized_weights_rows():
    q, sc, d = random_blocks(100, 96)
    packed = Q6Weight.from_blocks(q, sc, d)
    ids = torch.tensor([0, 99, 17, 17, 64, 15, 16])
    assert torch.equal(packed.rows(ids), packed.dequantize()[ids])
    assert packed.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 96)
    with pytest.raises(ValueError, match=r"row ids must lie in 0..99 .* got 0..100"):
        packed.rows(torch.tensor([0, 100]))


def test_a_float_weight_is_quantized_within_half_a_step():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen) * 0.05
    packed = Q6Weight(weight)
    q, sc, d = packed.blocks()
    step = (d.float().repeat_interleave(2, dim=1) * sc.float()).repeat_interleave(16, dim=1)
    assert ((packed.dequantize() - weight).abs() <= step / 2 * (1 + 1e-6)).all()


def test_bad_input_is_refused_by_name():
    q, sc, d = random_blocks(16, 64)
    with pytest.raises(QuantizeError, match=r"multiple of 32, got \[16, 40\]"):
        Q6Weight.from_blocks(torch.zeros(16, 40, dtype=torch.uint8), sc, d)
    with pytest.raises(QuantizeError, match="0..63, got one of 64"):
        Q6Weight.from_blocks(q.clone().fill_(64), sc, d)
    with pytest.raises(QuantizeError, match=r"uint8 .out, in., got torch.int8"):
        Q6Weight.from_blocks(q.to(torch.int8), sc, d)
    with pytest.raises(QuantizeError, match=r"sc must be int8 of shape \[16, 4\].*got torch.int16 \[16, 4\]"):
        Q6Weight.from_blocks(q, sc.to(torch.int16), d)
    with pytest.raises(QuantizeError, match=r"sc must be int8 of shape \[16, 4\].*got torch.int8 \[16, 2\]"):
        Q6Weight.from_blocks(q, sc[:, :2], d)
    with pytest.raises(QuantizeError, match="d hold a value that is not finite"):
        Q6Weight.from_blocks(q, sc, d.clone().fill_(float("inf")))
    with pytest.raises(QuantizeError, match=r"d must be exact in float16"):
        Q6Weight.from_blocks(q, sc, torch.full((16, 2), 0.1))

"""Float16 weights (tpserve/kernels/fp16_linear.py, the int8 format's down_proj): a row has the same bits
alone and among any number of rows, on every code path this CPU runs, and near the float64 product; where no C
kernel builds, FBGEMM's product in fixed tiles keeps the first promise."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels import fp16_linear
from tpserve.kernels.fp16_linear import Fp16Weight, supported_paths
from tpserve.kernels.int8_linear import QuantizeError, int8_available

# An output count off the groups of 16, and SmolLM2-135M's down_proj piece at tp=2.
SHAPES = ((37, 96), (576, 768))


def weight_and_rows(shape, num_rows=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=gen) * 0.05
    rows = torch.randn(num_rows, shape[1], generator=gen) * torch.rand(num_rows, 1, generator=gen) * 8
    rows[3] = 0
    return weight, rows


def kernel_paths():
    if not supported_paths():
        pytest.skip("no C kernel builds here")
    return supported_paths()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_the_same_alone_among_any_rows_and_on_every_path(shape):
    paths = kernel_paths()
    weight, rows = weight_and_rows(shape)
    packed = Fp16Weight(weight)
    whole = packed(rows)
    for num_rows in (*range(1, 18), 31, 33, 40):
        assert torch.equal(packed(rows[:num_rows]), whole[:num_rows]), f"{num_rows} rows"
    for i in (0, 3, 17, 39):
        assert torch.equal(packed(rows[i : i + 1]), whole[i : i + 1]), f"row {i} alone"
    for path in paths:  # scalar, avx2 and avx512 where this CPU runs them: one set of bits
        assert torch.equal(packed(rows, path=path), whole), path
    wide = torch.zeros(rows.shape[0], 2 * shape[1])
    wide[:, 1::2] = rows  # a strided input reads the same numbers
    assert torch.equal(packed(wide[:, 1::2]), whole)


def test_the_product_is_the_float16_weight_times_the_rows_in_float32():
    kernel_paths()
    weight, rows = weight_and_rows((37, 96))
    packed = Fp16Weight(weight)
    assert torch.equal(packed.dequantize(), weight.half().float())
    bias = torch.randn(37)
    exact = (rows.double() @ weight.half().double().t() + bias.double()).float()
    got = packed(rows, bias)
    assert got.shape == (40, 37) and got.dtype == torch.float32
    assert torch.allclose(got, exact, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], bias), "a row of zeros gives the bias alone"


def test_an_unknown_path_and_a_wrong_input_are_refused_by_name():
    kernel_paths()
    packed = Fp16Weight(torch.randn(16, 32))
    with pytest.raises(ValueError, match="unknown path 'neon'"):
        packed(torch.randn(2, 32), path="neon")
    with pytest.raises(ValueError, match=r"a \[T, 32\] input expected"):
        packed(torch.randn(2, 31))
    if "avx512" not in supported_paths():
        with pytest.raises(QuantizeError, match="avx512 path does not run on this CPU"):
            packed(torch.randn(2, 32), path="avx512")


@pytest.mark.skipif(int8_available() is not None, reason=str(int8_available()))
def test_without_a_c_kernel_fbgemm_in_fixed_tiles_keeps_a_row_the_same(monkeypatch):
    monkeypatch.setattr(fp16_linear, "_kernel", lambda: None)
    weight, rows = weight_and_rows((37, 96))
    packed = Fp16Weight(weight)
    assert torch.equal(packed.dequantize(), weight.half().float())
    whole = packed(rows)
    for num_rows in (1, 2, 5, 7, 14, 16, 17, 31, 32, 37, 38):
        assert torch.equal(packed(rows[:num_rows]), whole[:num_rows]), f"{num_rows} rows"

"""Int8 weights (tpserve/kernels/int8_linear.py): a row is the same at any batch, near the float product, and
refused by name where it cannot run. tp=2 == tp=1 and batched == solo on the tiny models are in
test_tp_exact.py; through the daemon in test_daemon_exact.py."""

from __future__ import annotations

import pytest
import torch
from served_pieces import piece_weight
from test_probe import tiny_rank

from tpserve.kernels.fp16_linear import Fp16Weight
from tpserve.kernels.int8_linear import Int8Weight, QuantizeError, int8_available
from tpserve.kernels.linear import linear
from tpserve.kernels.weight_formats import quantize_weight
from tpserve.ranks.errors import UserError
from tpserve.ranks.probe import probe_model
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import check_quantize
from tpserve.server.config import ConfigError, load_config

pytestmark = pytest.mark.skipif(int8_available() is not None, reason=str(int8_available()))


def weights_and_rows(out_features=160, in_features=96, num_rows=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    # Rows of very different sizes, and one of zeros (a padding row).
    rows = torch.randn(num_rows, in_features, generator=gen) * torch.rand(num_rows, 1, generator=gen) * 8
    rows[3] = 0
    return weight, rows


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["int8", "fp16"])
def test_a_row_is_the_same_alone_and_among_any_number_of_rows(kind, threads):
    weight, rows = weights_and_rows()
    packed = quantize_weight(weight, kind)
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([packed(rows[i : i + 1]) for i in range(len(rows))])
        for num_rows in (*range(1, 20), 31, 32, 33, 64, 70):
            assert torch.equal(packed(rows[:num_rows]), alone[:num_rows]), f"{num_rows} rows"
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))
        assert torch.equal(packed(rows[order]), alone[order])
    finally:
        torch.set_num_threads(1)


def test_the_product_is_near_the_float_one_and_linear_takes_it():
    weight, rows = weights_and_rows()
    bias = torch.randn(weight.shape[0])
    int8 = quantize_weight(weight, "int8")
    exact = rows @ weight.t() + bias
    got = linear(rows, int8, bias, row_tile=16)
    assert got.shape == exact.shape and got.dtype == torch.float32
    error = (got - exact).norm() / exact.norm()
    assert 0 < error < 0.02, f"relative error {error:.4f}"
    assert torch.equal(got[3], bias), "a row of zeros gives the bias alone"
    # The weight it computes with is the float one in whole steps of its output channel's absmax / 127.
    steps = int8.dequantize() / (weight.abs().amax(dim=1, keepdim=True) / 127)
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    # down_proj's float16 weight is the float one rounded to float16.
    fp16 = quantize_weight(weight, "fp16")
    assert torch.equal(fp16.dequantize(), weight.half().float())
    assert torch.allclose(linear(rows, fp16, bias), rows @ weight.half().float().t() + bias, atol=1e-5)


def test_the_start_up_probe_passes_on_int8_weights(tmp_path):
    torch.set_num_threads(2)
    try:
        for tp_rank, tp_size in ((0, 1), (1, 2)):
            model = tiny_rank(tmp_path / f"{tp_rank}-{tp_size}", "qwen2", tp_rank, tp_size, quantize="int8")
            layer = model.layers[0]
            assert isinstance(piece_weight(layer, 0, "w_qkv"), Int8Weight)
            assert isinstance(piece_weight(layer, 0, "w_down"), Fp16Weight)
            probe_model(model)
    finally:
        torch.set_num_threads(1)


def test_an_unknown_format_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="quantize.*int3.*none, int8, int4"):
        load_config(None, {"quantize": "int3"}, environ={})
    with pytest.raises(QuantizeError, match="int3"):
        quantize_weight(torch.ones(4, 4), "int3")


def test_what_int8_cannot_run_with_is_refused_before_loading():
    settings = EngineSettings(model_dir="unused", device="cpu", quantize="int8", dtype="bfloat16")
    with pytest.raises(UserError, match="int8 computes in float32, not dtype bfloat16"):
        check_quantize(settings, torch.device("cpu"))
    with pytest.raises(UserError, match="x86 CPUs.*not on cuda.*quantize: none"):
        check_quantize(
            EngineSettings(model_dir="unused", quantize="int8").for_device("cuda"), torch.device("cuda")
        )
    # As a rank checks it: with "auto" decided for its device (the CPU's dtype is float32).
    check_quantize(EngineSettings(model_dir="unused", quantize="int8").for_device("cpu"), torch.device("cpu"))

"""An fp8 checkpoint's weights as a GPU serves them (tpserve/ranks/packing.py pack_fp8): read as stored
(tpserve/ranks/fp8_tensors.py Fp8Values, a scale per output row), fused with each part keeping its scales,
and put to torch._scaled_mm (tpserve/kernels/fp8_linear.py Fp8Weight), run here through torch's CPU twin of
the product. Checked: which GPUs take them, that the fused fp8 weight holds the dequantized float
model's values bit for bit, and that its product is that model's within fp8 input rounding."""

from __future__ import annotations

import pytest

pytest.importorskip("compressed_tensors", minversion="0.20")  # the test extra's, on Python >= 3.11

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_fp8_checkpoint import fp8_model  # noqa: F401 (the module's checkpoints, written once)

from tpserve.kernels.fp8_linear import Fp8Weight
from tpserve.ranks.fp8_tensors import Fp8Values, StoredFp8
from tpserve.ranks.packing import fp8_on_gpu, fuse, pack_weight

LAYER = "model.layers.0."
FUSED = {
    "qkv": [LAYER + f"self_attn.{n}_proj.weight" for n in "qkv"],
    "gate_up": [LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight"],
}


def test_which_gpus_serve_fp8_weights_in_fp8():
    bf16, shape = torch.bfloat16, (192, 96)
    assert fp8_on_gpu("cuda", (9, 0), "none", bf16, shape)  # H100 / H200
    assert fp8_on_gpu("cuda", (12, 1), "none", bf16, shape)  # GB10
    assert not fp8_on_gpu("cuda", (8, 0), "none", bf16, shape)  # A100: no row-wise scaled product
    assert not fp8_on_gpu("cuda", (9, 0), "none", torch.float32, shape)  # the product returns bf16
    assert not fp8_on_gpu("cuda", (9, 0), "none", bf16, (200, 96))  # not multiples of 16
    assert not fp8_on_gpu("cuda", (9, 0), "none", bf16, (0, 96))  # a piece with no KV head
    assert not fp8_on_gpu("cpu", (0, 0), "none", bf16, shape)  # the CPU dequantizes at load


def stored(model_dir, names) -> list[Fp8Values]:
    path = model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        handles = {path: handle}
        files = dict.fromkeys(handle.keys(), path)
        return [StoredFp8(handles, files, name).read() for name in names]


@pytest.mark.parametrize("name", ["channel-bf16", "tensor-f16"])
def test_a_fused_fp8_weight_holds_the_dequantized_models_values(fp8_model, name):  # noqa: F811
    model_dir, twin = fp8_model(name)
    reference = load_file(twin / "model.safetensors")
    gen = torch.Generator().manual_seed(2)
    for product, names in FUSED.items():
        fused = fuse(dict(zip(names, stored(model_dir, names))), names)
        assert isinstance(fused, Fp8Values) and fused.values.dtype == torch.float8_e4m3fn
        weight = Fp8Weight(fused.values, fused.scales, torch.bfloat16)  # what pack_fp8 builds on a GPU
        expected = torch.cat([reference[n].float() for n in names])
        assert torch.equal(weight.dequantize(), expected), product
        x = torch.randn(5, expected.shape[1], generator=gen).to(torch.bfloat16)
        ours = weight(x).float()
        theirs = x.float() @ expected.T
        # inputs rounded to fp8 per row (3 significand bits: 1/16 relative), output to bfloat16
        assert (ours - theirs).abs().max() <= 0.1 * theirs.abs().max(), product
    # off a GPU the same weight is the dequantized float one, as the CPU serves it
    packed = pack_weight(fuse(dict(zip(FUSED["qkv"], stored(model_dir, FUSED["qkv"]))), FUSED["qkv"]), "none")
    assert isinstance(packed, torch.Tensor) and torch.equal(
        packed, torch.cat([reference[n].float() for n in FUSED["qkv"]])
    )

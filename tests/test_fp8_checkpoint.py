"""Compressed-tensors fp8 checkpoints written by the compressed-tensors library
(tpserve/ranks/fp8_tensors.py): dequantized to float32 at load, so every quantize serves exactly what it
serves for the library's dequantized float model, sharded like the float weights (the 3 KV heads split 2 + 1),
tp=2 == tp=1, and corrupt tensors refused by name at load."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("compressed_tensors", minversion="0.20")  # the test extra's, on Python >= 3.11

import torch
from multiproc import RankPool
from safetensors.torch import load_file
from served_pieces import piece_products
from test_int8_checkpoint import Q_PROJ, load
from test_tp_exact import PROMPTS, SAMPLINGS, _tp2, run_streams
from tiny_compressed_models import (
    decompressed,
    float_twin,
    fp8_args,
    fp8_inputs,
    write_compressed_checkpoint,
)
from tiny_models import with_tensors

from tpserve.kernels.weight_formats import quantize_unavailable
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import check_checkpoint_quantization

# name -> (strategy, scale dtype): W8A8 FP8 as llm-compressor's FP8_DYNAMIC writes it (one scale per
# row), and one scale per tensor in float16.
CASES = {"channel-bf16": ("channel", torch.bfloat16), "tensor-f16": ("tensor", torch.float16)}
QUANTIZE = [q for q in ("none", "int8", "int4") if quantize_unavailable(q, "cpu") is None]


@functools.cache
def _written(root, name: str):
    strategy, dtype = CASES[name]
    model_dir = write_compressed_checkpoint(
        root / name, "llama", args=fp8_args(strategy), inputs=fp8_inputs(), dtype=dtype
    )
    return model_dir, float_twin(model_dir, root / (name + "-dequantized"))


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """name -> (the case's checkpoint, its dequantized float twin), written once for the module."""
    return functools.partial(_written, tmp_path_factory.mktemp("fp8"))


def _values(weight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


@pytest.mark.parametrize("quantize", QUANTIZE)
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_piece_serves_what_the_dequantized_float_model_serves(fp8_model, name, quantize):
    model_dir, twin = fp8_model(name)
    for tp_rank, tp_size in ((0, 1), (0, 2), (1, 2)):
        served, reference = (load(d, tp_rank, tp_size, quantize=quantize) for d in (model_dir, twin))
        for layer, twin_layer in zip(served.layers, reference.layers):
            for index in range(len(served.pieces)):
                for ours, theirs in zip(piece_products(layer, index), piece_products(twin_layer, index)):
                    assert type(ours) is type(theirs)
                    assert torch.equal(_values(ours), _values(theirs))


def test_the_library_s_own_float_model_holds_the_served_values_rounded_once(fp8_model):
    # compressed-tensors decompresses in the scales' dtype: our float32 values rounded to it.
    model_dir, _ = fp8_model("channel-bf16")
    exact, native = decompressed(model_dir), decompressed(model_dir, scale_dtype=None)
    stored = load_file(model_dir / "model.safetensors")
    weight = stored[Q_PROJ + ".weight"].float() * stored[Q_PROJ + ".weight_scale"].float()
    assert torch.equal(exact[Q_PROJ + ".weight"], weight)
    for name, tensor in native.items():
        if tensor.dtype == torch.bfloat16:
            assert torch.equal(exact[name].to(torch.bfloat16), tensor), name


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


def test_tp2_equals_tp1_and_both_are_the_dequantized_float_model(pool, fp8_model):
    model_dir, twin = (str(d) for d in fp8_model("channel-bf16"))
    torch.set_num_threads(1)
    solo_logits, solo_tokens = run_streams(model_dir, 0, 1)
    pair_logits, pair_tokens = pool.run(_tp2, model_dir, "float32", "gloo", timeout_s=120)[0]
    assert pair_tokens == solo_tokens and torch.equal(pair_logits, solo_logits)
    twin_logits, _ = run_streams(twin, 0, 1)
    assert torch.equal(solo_logits, twin_logits)
    for lane, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        alone, _ = run_streams(model_dir, 0, 1, prompts=[prompt], samplings=[sampling])
        assert torch.equal(solo_logits[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


def test_an_fp8_checkpoint_needs_no_int8_products(fp8_model):
    config = load_model_config(fp8_model("channel-bf16")[0])
    assert config.quantization.describe() == "compressed-tensors fp8 (float-quantized), channel scales"
    settings = EngineSettings(model_dir="m", quantize="none").for_device("cuda")
    check_checkpoint_quantization(config, settings, torch.device("cuda"))


@pytest.mark.parametrize(
    "tensors, message",
    [
        (
            {Q_PROJ + ".weight_scale": torch.ones(96, 2)},
            "q_proj.weight_scale has shape \\[96, 2\\], expected \\[1\\]",
        ),
        (
            {Q_PROJ + ".weight_scale": torch.ones(96, 1, dtype=torch.int32)},
            "q_proj.weight_scale is I32, not a float",
        ),
        (
            {Q_PROJ + ".weight_scale": torch.zeros(96, 1)},
            "q_proj.weight_scale holds a scale that is not a positive",
        ),
        (
            {Q_PROJ + ".weight": torch.full((96, 96), float("nan")).to(torch.float8_e4m3fn)},
            "q_proj.weight holds a value that is not finite",
        ),
        (
            {Q_PROJ + ".weight": torch.zeros(96, 96, dtype=torch.float8_e5m2)},
            "q_proj.weight is F8_E5M2 \\[96, 96\\], not F8_E4M3",
        ),
    ],
)
def test_a_corrupt_or_unsupported_tensor_is_refused_by_name_at_load(fp8_model, tmp_path, tensors, message):
    source, _ = fp8_model("channel-bf16")
    model_dir = with_tensors(source, tmp_path / "m", tensors)
    with pytest.raises(ModelFileError, match=f"model.safetensors: tensor .*{message}"):
        load(model_dir)

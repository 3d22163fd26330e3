"""GPTQ (v1 and v2) and AWQ (GEMM) int4 checkpoints, packed as AutoGPTQ and AutoAWQ pack them
(tiny_gptq_models.py), read by tpserve/ranks/gptq_tensors.py: served as the file's own 4-bit blocks in int4
and dequantized exactly in none and int8, sharded like the float weights (the llama variant's 3 KV
heads split 2 + 1), every value AutoGPTQ's (AutoAWQ's) dequantization of the file bit for bit,
tp=2 == tp=1 and batched == solo, and what tpserve does not serve refused by name."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from multiproc import RankPool
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from served_pieces import piece_products
from test_int8_checkpoint import Q_PROJ, check_every_piece_serves, load, served_and_stored
from test_tp_exact import check_int4_logits_near_the_float_twin, check_tp2_equals_tp1_and_batched_equals_solo
from tiny_gptq_models import (
    PACKED,
    awq_config,
    dequantize,
    dequantize_awq,
    dequantized,
    gptq_config,
    pack,
    pack_awq,
    quantize,
    write_gptq_checkpoint,
)
from tiny_int8_models import float_twin
from tiny_models import WIDE, with_tensors

from tpserve.kernels.q4_linear import Q4Weight, q4_available
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.gptq_tensors import StoredAwq, StoredGptq
from tpserve.ranks.model_config import load_model_config

pytestmark = pytest.mark.skipif(q4_available() is not None, reason=str(q4_available()))

# name -> (method, variant, group_size, sym, config overrides). GPTQ: the uneven 2 + 1 KV split with
# symmetric groups of 32; groups of 64 over 96 inputs (the last one short) with zero points and
# biases; groups of 128 that a row-parallel piece cuts in half; one scale per output (group_size
# -1); GPTQModel's v2 (zero points stored as they are). AWQ (always zero points): the 2 + 1 split
# in groups of 32, biases, and groups of 128.
CASES = {
    "llama-g32-sym": ("gptq", "llama", 32, True, None),
    "qwen2-g64-asym": ("gptq", "qwen2", 64, False, {"num_key_value_heads": 3}),
    "mistral-g128-asym": ("gptq", "mistral", 128, False, WIDE),
    "llama-channel-asym": ("gptq", "llama", -1, False, None),
    "llama-g32-asym-v2": ("gptq_v2", "llama", 32, False, None),
    "awq-llama-g32": ("awq", "llama", 32, False, None),
    "awq-qwen2-g32": ("awq", "qwen2", 32, False, {"num_key_value_heads": 3}),
    "awq-mistral-g128": ("awq", "mistral", 128, False, WIDE),
}


@functools.cache
def _written(root, name: str):
    method, variant, group_size, sym, overrides = CASES[name]
    return write_gptq_checkpoint(
        root / name, variant, method=method, group_size=group_size, sym=sym, overrides=overrides
    )


@pytest.fixture(scope="module")
def gptq_model(tmp_path_factory):
    """name -> the case's checkpoint, written once for the module."""
    return functools.partial(_written, tmp_path_factory.mktemp("gptq"))


@pytest.mark.parametrize("quantize", ["int4", "none"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_piece_serves_the_values_autogptq_or_autoawq_dequantizes(gptq_model, name, quantize):
    # In int4 the blocks are the file's (dequantized, the library's arithmetic in float32 bit for
    # bit); in none the same values in float32.
    served_type = Q4Weight if quantize == "int4" else torch.Tensor
    check_every_piece_serves(gptq_model(name), dequantized(gptq_model(name)), quantize, served_type)


@pytest.mark.parametrize("name", ["qwen2-g64-asym", "awq-qwen2-g32"])
def test_the_librarys_float16_dequantization_is_ours_rounded_once(gptq_model, name):
    # scale * (q - z) is exact in float32 (11 significant bits times at most 16), so AutoGPTQ's and
    # AutoAWQ's float16 arithmetic rounds it once.
    model_dir = gptq_model(name)
    exact, half = dequantized(model_dir), dequantized(model_dir, torch.float16)
    for weight in exact:
        if weight.endswith("proj.weight"):
            assert torch.equal(exact[weight].half().float(), half[weight]), weight


def test_the_blocks_hold_the_files_scales_and_zero_points(gptq_model):
    model_dir = gptq_model("llama-g32-sym")
    stored = load_file(model_dir / "model.safetensors")
    q, d, m = (
        load(model_dir, quantize="int4").layers[0].self_attn.pieces[0].w_o.blocks()
    )  # piece 0: 64 columns
    scales = stored["model.layers.0.self_attn.o_proj.scales"][:2].t().float()  # [out, 2 groups]
    assert torch.equal(d.float(), scales) and torch.equal(m.float(), -8 * scales)  # sym: z = 7 + 1
    weight = dequantize({key: stored["model.layers.0.self_attn.o_proj." + key] for key in PACKED})
    assert torch.equal(d.float().repeat_interleave(32, 1) * (q.float() - 8), weight[:, :64])


@pytest.mark.parametrize(
    "packer, reference_of, stored_type, num_in",
    [(pack, dequantize, StoredGptq, 160), (pack_awq, dequantize_awq, StoredAwq, 192)],
)
def test_a_packed_weights_rows_and_columns_are_read_at_any_offset(
    tmp_path, packer, reference_of, stored_type, num_in
):
    # Packed as the library packs: columns (inputs) not on a whole int32 (8 values) nor a block (32:
    # then dequantized), rows (outputs) not on a whole int32; groups of 64, GPTQ's last one short.
    weight = torch.randn(24, num_in, generator=torch.Generator().manual_seed(1))
    q, zeros, scales = quantize(weight, 64, sym=False)
    tensors = packer(q, zeros, scales, 64)
    reference = reference_of(tensors)
    path = tmp_path / "packed.safetensors"
    save_file({"w." + key: value for key, value in tensors.items()}, str(path))
    with safe_open(str(path), framework="pt") as handle:
        stored = stored_type({path: handle}, dict.fromkeys(handle.keys(), path), "w.", 64)
        assert stored.shape == (24, num_in)
        for start, end in ((0, num_in), (32, 96), (5, 11), (60, 70), (128, 160), (3, 4)):
            part = stored.read(start, end, columns=True)
            assert isinstance(part, torch.Tensor) == bool(start % 32 or end % 32)
            served = part if isinstance(part, torch.Tensor) else part.dequantize()
            assert torch.equal(served, reference[:, start:end]), (start, end)
        for start, end in ((3, 13), (0, 5), (8, 9), (16, 24)):
            assert torch.equal(stored.read(start, end).dequantize(), reference[start:end])


def test_quantize_int8_serves_what_it_serves_for_the_dequantized_float_model(gptq_model, tmp_path):
    model_dir = gptq_model("llama-g32-sym")
    twin = float_twin(model_dir, tmp_path / "twin", dequantized(model_dir))
    served, reference = load(model_dir, quantize="int8"), load(twin, quantize="int8")
    for index in range(len(served.pieces)):
        for ours, theirs in zip(
            piece_products(served.layers[0], index), piece_products(reference.layers[0], index)
        ):
            assert torch.equal(ours.dequantize(), theirs.dequantize())


@pytest.mark.parametrize("name", ["llama-g32-sym", "awq-qwen2-g32"])
def test_the_logits_are_near_the_dequantized_float_model(gptq_model, tmp_path, name):
    model_dir = gptq_model(name)
    twin = float_twin(model_dir, tmp_path / "dequantized", dequantized(model_dir))
    check_int4_logits_near_the_float_twin(str(model_dir), str(twin))


@pytest.mark.parametrize(
    "name, described",
    [
        ("mistral-g128-asym", "gptq int4 (gptq), group 128 scales"),
        ("llama-channel-asym", "gptq int4 (gptq), channel scales"),
        ("llama-g32-asym-v2", "gptq int4 (gptq_v2), group 32 scales"),
        ("awq-llama-g32", "awq int4 (gemm), group 32 scales"),
    ],
)
def test_the_config_says_what_it_is(gptq_model, name, described):
    quantization = load_model_config(gptq_model(name)).quantization
    assert quantization.kinds == ("int4",) and quantization.describe() == described


def test_a_module_left_in_float_is_served_as_a_float_checkpoint_s(tmp_path):
    # AutoAWQ's modules_to_not_convert: no qweight, the float16 weight in its place.
    model_dir = write_gptq_checkpoint(tmp_path / "m", method="awq", keep_float=("mlp.down_proj",))
    file = dequantized(model_dir)
    assert "model.layers.0.mlp.down_proj.qweight" not in load_file(model_dir / "model.safetensors")
    for served, stored in served_and_stored(load(model_dir, 0, 2), file):
        assert torch.equal(served, stored)
    layer = load(model_dir, 0, 2, quantize="int4").layers[0]
    assert isinstance(layer.mlp.pieces[0].w_down, Q4Weight) and isinstance(
        layer.self_attn.pieces[0].w_o, Q4Weight
    )


def test_an_older_checkpoint_s_quantize_config_json_declares_its_scheme(gptq_model, tmp_path):
    # AutoGPTQ's own file, without quant_method, in place of config.json's quantization_config.
    model_dir = with_tensors(gptq_model("llama-g32-sym"), tmp_path / "m", {})
    config = json.loads((model_dir / "config.json").read_text())
    scheme = config.pop("quantization_config")
    del scheme["quant_method"]
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "quantize_config.json").write_text(json.dumps(scheme))
    assert load_model_config(model_dir).quantization.describe() == "gptq int4 (gptq), group 32 scales"
    file = dequantized(gptq_model("llama-g32-sym"))
    for served, stored in served_and_stored(load(model_dir, quantize="int4"), file):
        assert torch.equal(served.dequantize(), stored)
    (model_dir / "quantize_config.json").write_text(json.dumps(scheme | {"desc_act": True}))
    with pytest.raises(ModelFileError, match="gptq desc_act true"):
        load_model_config(model_dir)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("name", ["llama-g32-sym", "mistral-g128-asym", "awq-llama-g32"])
def test_tp2_equals_tp1_and_batched_equals_solo(pool, gptq_model, name):
    check_tp2_equals_tp1_and_batched_equals_solo(pool, str(gptq_model(name)), "int4")


# ---- refused by name ----


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bits": 8}, "gptq bits 8 are not supported, only 4"),
        ({"bits": 3}, "gptq bits 3 are not supported"),
        ({"desc_act": True}, "gptq desc_act true \\(activation order\\) is not supported"),
        ({"checkpoint_format": "gptq_v3"}, "gptq checkpoint_format 'gptq_v3' is not supported, only 'gptq'"),
        ({"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin' is not supported"),
        ({"is_marlin_format": True}, "gptq checkpoint_format 'marlin' is not supported"),
        ({"dynamic": {"-:.*lm_head": {}}}, "gptq dynamic \\(per-module bits or group sizes\\)"),
        ({"group_size": 0}, "gptq group_size 0 is not a positive integer or -1"),
        ({"group_size": None}, "gptq group_size None is not"),
        (awq_config(bits=8), "awq bits 8 are not supported, only 4"),
        (awq_config(version="gemv"), "awq version 'gemv' is not supported, only 'gemm'"),
        (awq_config(version="exllama"), "awq version 'exllama' is not supported"),
        (awq_config(zero_point=False), "awq zero_point false is not supported"),
        (awq_config(group_size=-2), "awq group_size -2 is not a positive integer or -1"),
    ],
)
def test_an_unsupported_config_is_refused_by_name_when_it_is_read(gptq_model, tmp_path, change, message):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    config = json.loads((gptq_model("llama-g32-sym") / "config.json").read_text())
    config["quantization_config"] = change if "quant_method" in change else gptq_config() | change
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=f"config.json: quantization_config: {message}"):
        load_model_config(model_dir)


@pytest.mark.parametrize(
    "tensors, message",
    [
        (
            {Q_PROJ + ".g_idx": torch.arange(96, dtype=torch.int32) % 3},
            "q_proj.g_idx is not i // group_size \\(32\\): activation order is not supported",
        ),
        (
            {Q_PROJ + ".qweight": torch.zeros(12, 96, dtype=torch.int16)},
            "q_proj.qweight is I16 \\[12, 96\\], not I32",
        ),
        (
            {Q_PROJ + ".qweight": torch.zeros(24, 96, dtype=torch.int32)},
            "q_proj.scales is F16 \\[3, 96\\], expected a float \\[6, 96\\] \\(in 192, group_size 32\\)",
        ),
        (
            {Q_PROJ + ".qzeros": torch.zeros(3, 96, dtype=torch.int32)},
            "q_proj.qzeros is I32 \\[3, 96\\], expected I32 \\[3, 12\\]",
        ),
        (
            {Q_PROJ + ".scales": torch.ones(96, 3, dtype=torch.float16)},
            "q_proj.scales is F16 \\[96, 3\\], expected a float \\[3, 96\\]",
        ),
        (
            {Q_PROJ + ".scales": torch.ones(3, 96, dtype=torch.int32)},
            "q_proj.scales is I32 \\[3, 96\\], expected a float",
        ),
        (
            {Q_PROJ + ".scales": torch.full((3, 96), float("nan"), dtype=torch.float16)},
            "q_proj.scales holds a scale that is not a positive finite number",
        ),
    ],
)
def test_a_corrupt_or_unsupported_tensor_is_refused_by_name_at_load(gptq_model, tmp_path, tensors, message):
    model_dir = with_tensors(gptq_model("llama-g32-sym"), tmp_path / "m", tensors)
    with pytest.raises(ModelFileError, match=f"model.safetensors: .*{message}"):
        load(model_dir)


@pytest.mark.parametrize("missing", ["qzeros", "scales"])
def test_a_missing_tensor_is_refused_by_name(gptq_model, tmp_path, missing):
    source = gptq_model("llama-g32-sym")
    model_dir = with_tensors(source, tmp_path / "m", {})
    stored = load_file(model_dir / "model.safetensors")
    del stored[f"{Q_PROJ}.{missing}"]
    save_file(stored, str(model_dir / "model.safetensors"))
    with pytest.raises(ModelFileError, match=f"q_proj.qweight has no {Q_PROJ}.{missing} beside it"):
        load(model_dir)

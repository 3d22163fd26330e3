"""Compressed-tensors int4 checkpoints written by the compressed-tensors library
(tpserve/ranks/int4_tensors.py): served as the file's own 4-bit blocks in int4 and dequantized exactly in none
and int8, sharded like the float weights (the llama variant's 3 KV heads split 2 + 1), tp=2 == tp=1 and
batched == solo bit for bit, near the library's own dequantized float model, and anything tpserve does not
serve refused by name at load."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("compressed_tensors", minversion="0.20")  # the test extra's, on Python >= 3.11

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from daemon import read_reply, running_daemon
from multiproc import RankPool
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from served_pieces import piece_products, piece_weight
from test_int8_checkpoint import Q_PROJ, check_every_piece_serves, load, served_and_stored
from test_tp_exact import (
    NUM_STEPS,
    PROMPTS,
    check_int4_logits_near_the_float_twin,
    check_tp2_equals_tp1_and_batched_equals_solo,
    run_streams,
)
from tiny_compressed_models import decompressed, float_twin, weight_args, write_compressed_checkpoint
from tiny_models import WIDE, with_tensors

from tpserve.kernels.fp16_linear import Fp16Weight
from tpserve.kernels.int8_linear import Int8Weight
from tpserve.kernels.q4_linear import Q4Weight, q4_available
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.int4_tensors import StoredInt4
from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.packing import describe_serving
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import check_checkpoint_quantization
from tpserve.v1 import serving_pb2

pytestmark = pytest.mark.skipif(q4_available() is not None, reason=str(q4_available()))

# name -> (variant, weight args, scale dtype, config overrides): the uneven 2 + 1 KV split with
# symmetric groups of 32 in bfloat16; zero points in float16 with biases (3 KV heads too, so that
# o_proj's pieces are whole blocks, 64 + 32 columns); groups of 128 that a row-parallel piece cuts
# in half; one scale per row.
CASES = {
    "llama-g32-bf16": ("llama", weight_args(), torch.bfloat16, None),
    "qwen2-g32-asym-f16": ("qwen2", weight_args(symmetric=False), torch.float16, {"num_key_value_heads": 3}),
    "mistral-g128-asym-bf16": ("mistral", weight_args(group_size=128, symmetric=False), torch.bfloat16, WIDE),
    "llama-channel-f16": ("llama", weight_args("channel"), torch.float16, None),
}


@functools.cache
def _written(root, name: str):
    variant, args, dtype, overrides = CASES[name]
    return write_compressed_checkpoint(root / name, variant, args=args, dtype=dtype, overrides=overrides)


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    """name -> the case's checkpoint, written once for the module."""
    return functools.partial(_written, tmp_path_factory.mktemp("int4"))


def _served(weight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


@pytest.mark.parametrize("quantize", ["int4", "none"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_piece_serves_the_values_compressed_tensors_decompresses(int4_model, name, quantize):
    # In int4 the blocks are the file's (dequantized, they are the library's float32 decompression
    # bit for bit); in none the same values in float32.
    served_type = Q4Weight if quantize == "int4" else torch.Tensor
    check_every_piece_serves(int4_model(name), decompressed(int4_model(name)), quantize, served_type)


@pytest.mark.parametrize("dtype, layout", [(torch.bfloat16, torch.float16), (torch.float32, torch.float32)])
def test_the_blocks_hold_the_files_scales_as_they_are(tmp_path, dtype, layout):
    # Scales float16 holds exactly (bfloat16 ones of the usual sizes) are packed in float16, float32
    # ones in the float32 layout: d = scale and m = -8 * scale either way, never rounded.
    model_dir = write_compressed_checkpoint(tmp_path / "m", dtype=dtype)
    stored = load_file(model_dir / "model.safetensors")
    w_o = load(model_dir, quantize="int4").layers[0].self_attn.pieces[0].w_o
    assert w_o.scale_dtype == layout
    q, d, m = w_o.blocks()  # piece 0's columns: 2 KV heads of 2 x 16 = 64, two groups of 32
    module = "model.layers.0.self_attn.o_proj.weight"
    scales = stored[module + "_scale"][:, :2].float()
    assert torch.equal(d.float(), scales) and torch.equal(m.float(), -8 * scales)
    values = unpack_from_int32(stored[module + "_packed"], 4, stored[module + "_shape"])
    assert torch.equal(q, (values[:, :64] + 8).to(torch.uint8))  # the nibbles as packed, u = v + 8


def test_float32_zero_points_keep_the_files_blocks_within_an_ulp_or_two_of_m(tmp_path):
    # m = -z * scale rounds once in float32: the blocks stay the file's, their values within float32's
    # rounding of the library's decompression.
    args = weight_args(symmetric=False)
    model_dir = write_compressed_checkpoint(tmp_path / "m", args=args, dtype=torch.float32)
    file = decompressed(model_dir)
    for served, stored in served_and_stored(load(model_dir, quantize="int4"), file):
        assert isinstance(served, Q4Weight) and served.scale_dtype == torch.float32
        # An ulp or two of m (about 15 * scale), not of the value (which may nearly cancel).
        torch.testing.assert_close(
            served.dequantize(), stored, rtol=0, atol=2**-20 * float(stored.abs().max())
        )


def test_the_library_s_own_float_model_holds_the_served_values_rounded_once(int4_model):
    # compressed-tensors decompresses in the scales' dtype: our float32 values rounded to it.
    model_dir = int4_model("llama-g32-bf16")
    exact, native = decompressed(model_dir), decompressed(model_dir, scale_dtype=None)
    for name, weight in native.items():
        if weight.dtype == torch.bfloat16:
            assert torch.equal(exact[name].to(torch.bfloat16), weight), name


def test_quantize_int8_serves_what_it_serves_for_the_dequantized_float_model(int4_model, tmp_path):
    # none and int8 take the file's values dequantized exactly, as they do a GGUF's blocks.
    model_dir = int4_model("llama-g32-bf16")
    twin = float_twin(model_dir, tmp_path / "twin")
    served, reference = load(model_dir, quantize="int8"), load(twin, quantize="int8")
    for index in range(len(served.pieces)):
        layer = served.layers[0]
        assert isinstance(piece_weight(layer, index, "w_qkv"), Int8Weight)
        assert isinstance(piece_weight(layer, index, "w_down"), Fp16Weight)
        for ours, theirs in zip(piece_products(layer, index), piece_products(reference.layers[0], index)):
            assert torch.equal(ours.dequantize(), theirs.dequantize())


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("name", ["llama-g32-bf16", "mistral-g128-asym-bf16"])
def test_tp2_equals_tp1_and_batched_equals_solo(pool, int4_model, name):
    check_tp2_equals_tp1_and_batched_equals_solo(pool, str(int4_model(name)), "int4")


@pytest.mark.parametrize("name", ["llama-g32-bf16", "qwen2-g32-asym-f16"])
def test_the_logits_are_near_the_librarys_dequantized_float_model(int4_model, tmp_path, name):
    model_dir = int4_model(name)
    check_int4_logits_near_the_float_twin(
        str(model_dir), str(float_twin(model_dir, tmp_path / "dequantized"))
    )


def test_groups_that_are_not_whole_blocks_are_served_dequantized(tmp_path):
    # Groups of 16: no 4-bit block holds one scale, so the weights load as their float32 values.
    model_dir = write_compressed_checkpoint(
        tmp_path / "g16", args=weight_args(group_size=16), dtype=torch.float16
    )
    file = decompressed(model_dir)
    model = load(model_dir)
    start, end = model.pieces[0].intermediate
    assert torch.equal(
        model.layers[1].mlp.pieces[0].w_down, file["model.layers.1.mlp.down_proj.weight"][:, start:end]
    )
    assert isinstance(
        load(model_dir, quantize="int4").layers[1].mlp.pieces[0].w_down, Q4Weight
    )  # quantized at load


def test_a_row_parallel_piece_off_the_block_edges_is_served_dequantized(tmp_path):
    # Mistral's 2 KV heads of 3 x 16 queries: each piece's o_proj is 48 columns, not whole blocks.
    model_dir = write_compressed_checkpoint(tmp_path / "mistral", "mistral")
    for served, stored in served_and_stored(load(model_dir, 0, 2), decompressed(model_dir)):
        assert torch.equal(served, stored)  # quantize none: every value the file's
    layer = load(model_dir, 0, 2, quantize="int4").layers[0]
    assert isinstance(
        piece_weight(layer, 0, "w_o"), Int8Weight
    )  # quantized at load, as a float weight of 48 inputs is
    assert isinstance(piece_weight(layer, 0, "w_qkv"), Q4Weight) and isinstance(
        piece_weight(layer, 0, "w_down"), Q4Weight
    )


def test_a_packed_weights_rows_and_columns_are_read_at_any_offset(tmp_path):
    # Values packed by the library: columns not on a whole int32 (8 values) nor a block (32: then
    # dequantized), zero points' rows not on a whole int32 (8 outputs).
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(-8, 8, (13, 128), generator=gen, dtype=torch.int8)
    zero_points = torch.randint(-8, 8, (13, 2), generator=gen, dtype=torch.int8)
    scales = (torch.rand(13, 2, generator=gen) + 0.5).to(torch.bfloat16)
    weight = (
        values.float() - zero_points.float().repeat_interleave(64, 1)
    ) * scales.float().repeat_interleave(64, 1)
    path = tmp_path / "packed.safetensors"
    save_file(
        {
            "w.weight_packed": pack_to_int32(values, 4),
            "w.weight_shape": torch.tensor([13, 128]),
            "w.weight_scale": scales,
            "w.weight_zero_point": pack_to_int32(zero_points, 4, packed_dim=0),
        },
        str(path),
    )
    with safe_open(str(path), framework="pt") as handle:
        stored = StoredInt4({path: handle}, dict.fromkeys(handle.keys(), path), "w.weight")
        for start, end in ((0, 128), (32, 96), (5, 11), (60, 70), (64, 128), (3, 4)):
            part = stored.read(start, end, columns=True)
            assert isinstance(part, torch.Tensor) == bool(start % 32 or end % 32)
            assert torch.equal(_served(part), weight[:, start:end]), (start, end)
        for start, end in ((3, 13), (0, 5), (8, 9)):
            assert torch.equal(stored.read(start, end).dequantize(), weight[start:end])


def test_an_int4_checkpoint_needs_no_int8_products(int4_model):
    # Dequantized where int4 is not served, it loads on any device in any dtype.
    config = load_model_config(int4_model("llama-g32-bf16"))
    assert config.quantization.kinds == ("int4",)
    assert config.quantization.describe() == "compressed-tensors int4 (pack-quantized), group 32 scales"
    for device, dtype in (("cuda", "float32"), ("cpu", "bfloat16")):
        settings = EngineSettings(model_dir="m", quantize="none", dtype=dtype).for_device(device)
        check_checkpoint_quantization(config, settings, torch.device(device))


def test_the_start_up_log_says_which_layers_are_served_as_stored():
    assert describe_serving(("int4",), "int4") == (
        "its int4 layers served as stored, quantize int4 applies to those it left in float"
    )
    assert describe_serving(("int8", "int4"), "none") == (
        "its int8 layers served as stored, its int4 layers dequantized to float32, quantize none "
        "applies to them and to those it left in float"
    )


def test_the_two_rank_daemon_serves_it_in_int4_with_the_tokens_one_rank_computes(int4_model, tmp_path):
    model_dir = int4_model("llama-g32-bf16")
    torch.set_num_threads(1)
    greedy = [SamplingParams()] * len(PROMPTS)
    _, solo_tokens = run_streams(str(model_dir), 0, 1, prompts=PROMPTS, samplings=greedy, quantize="int4")
    requests = [
        serving_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=NUM_STEPS, ignore_eos=True)
        for prompt in PROMPTS
    ]
    with running_daemon("spawn", model_dir, tmp_path / "logs", "--quantize", "int4") as daemon:
        with ThreadPoolExecutor(len(requests)) as threads:
            replies = list(threads.map(lambda r: read_reply(daemon.stub.Generate(r, timeout=300)), requests))
        assert (
            "its int4 layers served as stored, quantize int4 applies to those it left in float"
            in daemon.logs()
        )
    for lane, reply in enumerate(replies):
        assert reply.ok and reply.token_ids == [step[lane] for step in solo_tokens], f"prompt {lane}"


# ---- refused by name ----


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_bits": 2}, "int2 weights are not supported, only int8 and int4"),
        ({"num_bits": 3}, "int3 weights are not supported"),
        ({"format": "int-quantized"}, "int4 weights need format 'pack-quantized', not 'int-quantized'"),
        ({"strategy": "tensor", "group_size": None}, "int4 weight strategy 'tensor' is not supported"),
        ({"strategy": "block", "block_structure": [32, 32]}, "int4 weight strategy 'block' is not supported"),
        ({"strategy": "group", "group_size": None}, "strategy 'group' with group_size None"),
        ({"actorder": "group"}, "actorder 'group' is not supported"),
        ({"dynamic": True}, "dynamic weight scales are not supported"),
        (
            {"type": "float", "num_bits": 8, "strategy": "channel"},
            "fp8 weights need format 'float-quantized' or 'naive-quantized'",
        ),
        ({"type": "float", "num_bits": 4}, "float weights \\(num_bits 4\\) are not supported"),
    ],
)
def test_an_unsupported_scheme_is_refused_by_name_when_the_config_is_read(
    int4_model, tmp_path, change, message
):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    config = json.loads((int4_model("llama-g32-bf16") / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    if "format" in change:
        group["format"] = change.pop("format")
    group["weights"].update(change)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=f"config.json: quantization_config: .*{message}"):
        load_model_config(model_dir)


@pytest.mark.parametrize(
    "tensors, message",
    [
        (
            {Q_PROJ + ".weight_packed": torch.zeros(96, 24, dtype=torch.int32)},
            "q_proj.weight_packed is I32 \\[96, 24\\], weight_shape \\[96, 96\\] implies I32 \\[96, 12\\]",
        ),
        (
            {Q_PROJ + ".weight_scale": torch.ones(96, 5)},
            "q_proj.weight_scale has shape \\[96, 5\\], expected",
        ),
        (
            {Q_PROJ + ".weight_scale": torch.ones(96, 3, dtype=torch.int32)},
            "q_proj.weight_scale is I32, not a float",
        ),
        (
            {Q_PROJ + ".weight_scale": torch.full((96, 3), float("nan"))},
            "q_proj.weight_scale holds a scale that is not",
        ),
        (
            {Q_PROJ + ".weight_g_idx": torch.zeros(96, dtype=torch.int32)},
            "q_proj.weight_g_idx: activation order",
        ),
        (
            {Q_PROJ + ".weight_zero_point": torch.zeros(96, 3, dtype=torch.int32)},
            "q_proj.weight_zero_point is I32 \\[96, 3\\], expected I32 \\[12, 3\\]",
        ),
        (
            {Q_PROJ + ".weight_shape": torch.tensor([96])},
            "q_proj.weight_shape is \\[96\\], not \\[out, in\\]",
        ),
    ],
)
def test_a_corrupt_or_unsupported_tensor_is_refused_by_name_at_load(int4_model, tmp_path, tensors, message):
    source = int4_model("llama-g32-bf16")
    model_dir = with_tensors(source, tmp_path / "m", tensors)
    with pytest.raises(ModelFileError, match=f"model.safetensors: tensor .*{message}"):
        load(model_dir)

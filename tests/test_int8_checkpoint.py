"""Compressed-tensors int8 checkpoints (tpserve/ranks/int8_tensors.py,
tpserve/ranks/checkpoint_quantization.py): the file's own int8 values and scales are what the products compute
with, sharded like the float weights (the llama variant's 3 KV heads split 2 + 1), tp=2 == tp=1 and batched ==
solo bit for bit, near the dequantized float model, and anything tpserve does not serve refused by name at
load."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from daemon import read_reply, running_daemon, write_daemon_model
from multiproc import RankPool, world_collectives
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from served_pieces import piece_weight
from test_tp_exact import NUM_STEPS, PROMPTS, SAMPLINGS, run_streams
from tiny_int8_models import (
    FORMATS,
    dequantized,
    float_twin,
    pack_int32,
    quantize_per_channel,
    write_int8_checkpoint,
)
from tiny_models import write_tiny_model

from tpserve.kernels.int8_linear import Int8Weight, int8_available, reduce_range
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import ModelFileError, UserError
from tpserve.ranks.int8_tensors import StoredInt8
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.sharding import piece_range
from tpserve.ranks.startup import check_checkpoint_quantization
from tpserve.v1 import serving_pb2

pytestmark = pytest.mark.skipif(int8_available() is not None, reason=str(int8_available()))

# (variant, format, ignore): the uneven KV split with a tied head; biases with an int8 head.
CASES = [("llama", "int-quantized", ("lm_head",)), ("qwen2", "pack-quantized", ())]


def int8_model(tmp_path, variant: str, fmt: str, ignore=("lm_head",), **kwargs):
    float_dir = write_tiny_model(tmp_path / f"{variant}-float", variant)
    return write_int8_checkpoint(float_dir, tmp_path / f"{variant}-{fmt}", fmt, ignore, **kwargs)


def load(model_dir, tp_rank=0, tp_size=1, quantize="none"):
    return load_rank_model(
        model_dir, tp_rank=tp_rank, tp_size=tp_size, dtype=torch.float32, max_positions=64, quantize=quantize
    )


def piece_of(file, config, piece, prefix: str, module: str, unit: str, columns: bool = False):
    """`piece`'s rows (or columns) of the file's dequantized weight of `module`."""
    start, end = piece_range(config, piece, unit)
    weight = file[prefix + module + ".weight"]
    return weight[:, start:end] if columns else weight[start:end]


def served_and_stored(model, file):
    """(served product, the file's weights of its piece: rows stacked as it fuses them) for every
    layer product of every piece of `model`."""
    for index, layer in enumerate(model.layers):
        for piece, attention, mlp in zip(model.pieces, layer.self_attn.pieces, layer.mlp.pieces):
            part = functools.partial(piece_of, file, model.config, piece, f"model.layers.{index}.")
            qkv = [part(f"self_attn.{n}_proj", u) for n, u in zip("qkv", ("q_heads", "kv_heads", "kv_heads"))]
            gate_up = [part(f"mlp.{n}_proj", "intermediate") for n in ("gate", "up")]
            yield attention.w_qkv, torch.cat(qkv)
            yield mlp.w_gate_up, torch.cat(gate_up)
            yield attention.w_o, part("self_attn.o_proj", "q_heads", columns=True)
            yield mlp.w_down, part("mlp.down_proj", "intermediate", columns=True)


def check_every_piece_serves(model_dir, file, quantize: str, served_type) -> None:
    """At tp=1 and on both ranks of tp=2, every layer product is a `served_type` holding the file's
    values (`file`, dequantized) exactly."""
    for tp_rank, tp_size in ((0, 1), (0, 2), (1, 2)):
        model = load(model_dir, tp_rank, tp_size, quantize=quantize)
        for served, stored in served_and_stored(model, file):
            assert isinstance(served, served_type)
            assert torch.equal(served if isinstance(served, torch.Tensor) else served.dequantize(), stored)


@pytest.mark.parametrize("variant, fmt, ignore", CASES)
def test_every_piece_computes_with_the_files_int8_values_and_scales(tmp_path, variant, fmt, ignore):
    model_dir = int8_model(tmp_path, variant, fmt, ignore, scale_dtype=torch.bfloat16)
    file = dequantized(model_dir)
    for tp_rank, tp_size in ((0, 1), (0, 2), (1, 2)):
        model = load(model_dir, tp_rank, tp_size)
        config = model.config
        # down_proj too: the file ships it in int8, so it is served in int8 (not float16).
        for served, stored in served_and_stored(model, file):
            assert isinstance(served, Int8Weight)
            assert torch.equal(served.dequantize(), stored)
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        for piece, served in zip(model.pieces, model.lm_head.weights):
            start, end = piece.vocab
            if ignore:  # the ignored head (or a tied one) is float, and quantize none keeps it so
                assert not isinstance(served, Int8Weight)
                assert torch.equal(served, file[head][start:end])
            else:
                assert torch.equal(served.dequantize(), file[head][start:end])


def test_quantize_int8_applies_only_to_what_the_file_left_in_float(tmp_path):
    model_dir = int8_model(tmp_path, "mistral", "int-quantized", ignore=("lm_head",))
    file = dequantized(model_dir)
    plain, quantized = load(model_dir), load(model_dir, quantize="int8")
    assert not isinstance(plain.lm_head.weights[0], Int8Weight)
    assert isinstance(quantized.lm_head.weights[0], Int8Weight)  # the float head, quantized at load
    start, end = plain.pieces[0].vocab
    steps = quantized.lm_head.weights[0].dequantize() / (
        file["lm_head.weight"][start:end].abs().amax(1, keepdim=True) / 127
    )
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    # The file's int8 layers are the same either way, down_proj still int8 (not float16).
    for index in range(len(plain.pieces)):
        before, after = (
            {name: piece_weight(model.layers[0], index, name) for name in ("w_down", "w_qkv")}
            for model in (plain, quantized)
        )
        assert isinstance(after["w_down"], Int8Weight)
        assert torch.equal(before["w_down"].dequantize(), after["w_down"].dequantize())
        assert torch.equal(before["w_qkv"].dequantize(), after["w_qkv"].dequantize())


def test_a_packed_weights_columns_are_read_at_any_offset(tmp_path):
    # A row-parallel piece's columns need not start on a whole int32 (4 values): read them
    # through the int32s that hold them.
    values, scale = quantize_per_channel(torch.randn(6, 23))
    path = tmp_path / "packed.safetensors"
    save_file(
        {
            "w.weight_packed": pack_int32(values),
            "w.weight_shape": torch.tensor([6, 23], dtype=torch.int32),
            "w.weight_scale": scale,
        },
        str(path),
    )
    with safe_open(str(path), framework="pt") as handle:
        files = dict.fromkeys(handle.keys(), path)
        stored = StoredInt8({path: handle}, files, "w.weight")
        for start, end in ((0, 23), (5, 11), (3, 4), (21, 23), (8, 12)):
            part = stored.read(start, end, columns=True)
            assert torch.equal(part.values, values[:, start:end]) and torch.equal(part.scales, scale.view(-1))
        part = stored.read(2, 5)
        assert torch.equal(part.values, values[2:5]) and torch.equal(part.scales, scale.view(-1)[2:5])


def _tp2(ctx, model_dir):
    torch.set_num_threads(1)
    return run_streams(model_dir, ctx.rank, 2, "float32", world_collectives(ctx, "gloo"))


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("variant, fmt, ignore", CASES)
def test_tp2_equals_tp1_and_batched_equals_solo(pool, tmp_path, variant, fmt, ignore):
    model_dir = str(int8_model(tmp_path, variant, fmt, ignore))
    torch.set_num_threads(1)
    solo_logits, solo_tokens = run_streams(model_dir, 0, 1)
    pair_logits, pair_tokens = pool.run(_tp2, model_dir, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    assert torch.equal(pair_logits, solo_logits)
    for lane, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        alone, _ = run_streams(model_dir, 0, 1, prompts=[prompt], samplings=[sampling])
        assert torch.equal(solo_logits[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_logits_are_near_those_of_the_dequantized_float_model(tmp_path, fmt):
    model_dir = int8_model(tmp_path, "llama", fmt)
    reference = float_twin(model_dir, tmp_path / "dequantized")
    torch.set_num_threads(1)
    int8_logits, _ = run_streams(str(model_dir), 0, 1, prompts=PROMPTS[:1], samplings=SAMPLINGS[:1])
    float_logits, _ = run_streams(str(reference), 0, 1, prompts=PROMPTS[:1], samplings=SAMPLINGS[:1])
    first_int8, first_float = int8_logits[0], float_logits[0]  # the prompt's logits
    error = (first_int8 - first_float).norm() / first_float.norm()
    # Only the inputs' rounding (int8 per row) stands between them: the weights are the same numbers.
    # In 7 bits where FBGEMM's product lacks AVX-512 VNNI (tpserve/kernels/int8_linear.py's reduce_range).
    bound = 0.15 if reduce_range() else 0.05
    assert 0 < error < bound, f"int8 logits {error:.4f} away from the dequantized float model (relative)"
    assert torch.equal(first_int8.argmax(-1), first_float.argmax(-1))


# ---- refused by name ----

Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_bits": 4}, "int4 weights need format 'pack-quantized', not 'int-quantized'"),
        ({"format": "pack-quantized", "num_bits": 2}, "int2 weights are not supported, only int8 and int4"),
        ({"strategy": "group", "group_size": 128}, "weight strategy 'group' is not supported"),
        ({"strategy": "block", "block_structure": [128, 128]}, "weight strategy 'block' is not supported"),
        ({"strategy": "tensor"}, "weight strategy 'tensor' is not supported"),
        ({"symmetric": False}, "asymmetric weights"),
        (
            {"type": "float"},
            "fp8 weights need format 'float-quantized' or 'naive-quantized', not 'int-quantized'",
        ),
        (
            {"format": "float-quantized"},
            "int8 weights need format 'int-quantized' or .*, not 'float-quantized'",
        ),
        ({"format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized' is not supported"),
        ({"format": "marlin-24"}, "format 'marlin-24' is not supported"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity format 'sparse-24-bitmask'"),
        ({"transform_config": {"config_groups": {}}}, "transform_config is not supported"),
    ],
)
def test_an_unsupported_scheme_is_refused_by_name_when_the_config_is_read(tmp_path, change, message):
    model_dir = int8_model(tmp_path, "llama", "int-quantized")
    config = json.loads((model_dir / "config.json").read_text())
    quant = config["quantization_config"]
    fmt = change.pop("format", None)
    for key in ("quant_method", "sparsity_config", "transform_config"):
        if key in change:
            quant[key] = change.pop(key)
    if fmt:
        quant["format"] = fmt
    quant["config_groups"]["group_0"]["weights"].update(change)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=f"config.json: quantization_config: .*{message}"):
        load_model_config(model_dir)


def _scale(shape):
    return torch.full(shape, 0.01)


@pytest.mark.parametrize(
    "tensors, message",
    [
        (
            {Q_PROJ + ".weight_scale": _scale((96, 2))},
            "q_proj.weight_scale has shape \\[96, 2\\], expected \\[96, 1\\]",
        ),
        (
            {Q_PROJ + ".weight_scale": _scale((1,))},
            "q_proj.weight_scale has shape \\[1\\], expected \\[96, 1\\]",
        ),
        (
            {Q_PROJ + ".weight": torch.zeros(96, 96)},
            "q_proj.weight is F32, but its weight_scale declares int8",
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
            {Q_PROJ + ".weight_zero_point": torch.ones(96, 1, dtype=torch.int8)},
            "q_proj.weight_zero_point: zero points",
        ),
        (
            {Q_PROJ + ".weight_g_idx": torch.zeros(96, dtype=torch.int32)},
            "q_proj.weight_g_idx: activation order",
        ),
        (
            {"model.embed_tokens.weight": torch.zeros(259, 96, dtype=torch.int8)},
            "embed_tokens.weight is I8, not a float",
        ),
        (
            {"model.layers.0.mlp.down_proj.weight": torch.zeros(96, 128, dtype=torch.float8_e4m3fn)},
            "down_proj.weight is F8_E4M3, but its weight_scale declares int8",
        ),
    ],
)
def test_a_corrupt_or_unsupported_tensor_is_refused_by_name_at_load(tmp_path, tensors, message):
    model_dir = int8_model(tmp_path, "llama", "int-quantized", tensors=tensors)
    with pytest.raises(ModelFileError, match=f"model.safetensors: tensor .*{message}"):
        load(model_dir)


def test_a_fp8_or_integer_tensor_in_a_float_checkpoint_is_refused_by_name(tmp_path):
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    weights = load_file(model_dir / "model.safetensors")
    weights[Q_PROJ + ".weight"] = weights[Q_PROJ + ".weight"].to(torch.float8_e4m3fn)
    save_file(weights, str(model_dir / "model.safetensors"))
    with pytest.raises(
        ModelFileError,
        match="tensor .*q_proj.weight is F8_E4M3, not a float .config.json declares no quantization",
    ):
        load(model_dir)


def test_a_packed_weight_of_the_wrong_shape_is_refused_by_name(tmp_path):
    wrong = {Q_PROJ + ".weight_packed": torch.zeros(96, 23, dtype=torch.int32)}
    model_dir = int8_model(tmp_path, "llama", "pack-quantized", tensors=wrong)
    with pytest.raises(
        ModelFileError,
        match="q_proj.weight_packed is I32 \\[96, 23\\], weight_shape \\[96, 96\\] implies I32 \\[96, 24\\]",
    ):
        load(model_dir)


def test_a_fused_product_stored_partly_in_float_is_refused_by_name(tmp_path):
    # q, k and v run as one product: the file cannot leave only k_proj in float.
    model_dir = int8_model(
        tmp_path, "llama", "int-quantized", ignore=("lm_head", Q_PROJ.replace("q_proj", "k_proj"))
    )
    with pytest.raises(
        ModelFileError, match="q_proj.weight, .*k_proj.weight, .*: one fused product, stored partly"
    ):
        load(model_dir)


def test_a_device_or_dtype_without_int8_products_refuses_the_checkpoint_by_name(tmp_path):
    config = load_model_config(int8_model(tmp_path, "llama", "int-quantized"))
    on_cpu = EngineSettings(model_dir="m", quantize="none").for_device("cpu")
    check_checkpoint_quantization(config, on_cpu, torch.device("cpu"))
    with pytest.raises(
        UserError,
        match="compressed-tensors int8 .* checkpoint: int8 weights run on x86 CPUs .*not on cuda; serve a float",
    ):
        check_checkpoint_quantization(
            config, EngineSettings(model_dir="m").for_device("cuda"), torch.device("cuda")
        )
    with pytest.raises(UserError, match="compute in float32, not dtype bfloat16"):
        check_checkpoint_quantization(
            config, EngineSettings(model_dir="m", device="cpu", dtype="bfloat16"), torch.device("cpu")
        )


# ---- through the daemon ----


def test_the_two_rank_daemon_serves_it_with_the_tokens_one_rank_computes(tmp_path):
    model_dir = write_int8_checkpoint(write_daemon_model(tmp_path / "float"), tmp_path / "int8")
    torch.set_num_threads(1)
    greedy = [SamplingParams()] * len(PROMPTS)
    # --quantize int8: the tied head, which the file keeps in float, is quantized at load on both sides.
    _, solo_tokens = run_streams(str(model_dir), 0, 1, prompts=PROMPTS, samplings=greedy, quantize="int8")
    requests = [
        serving_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=NUM_STEPS, ignore_eos=True)
        for prompt in PROMPTS
    ]
    with running_daemon("spawn", model_dir, tmp_path / "logs", "--quantize", "int8") as daemon:
        with ThreadPoolExecutor(len(requests)) as threads:
            replies = list(threads.map(lambda r: read_reply(daemon.stub.Generate(r, timeout=300)), requests))
        assert (
            "int8 layers served as stored, quantize int8 applies to those it left in float" in daemon.logs()
        )
    for lane, reply in enumerate(replies):
        assert reply.ok and reply.token_ids == [step[lane] for step in solo_tokens], f"prompt {lane}"

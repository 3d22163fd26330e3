"""gpt-oss (tpserve/ranks/models/gpt_oss.py) against transformers' own GptOssForCausalLM on a tiny model it
writes itself: sliding (window 8) and full layers that a 90-token prompt outgrows, sinks, biases on q/k/v/o,
the router and the experts, the clamped GLU, yarn; tp=2 against tp=1 bit for bit, batched against solo, chunks
against the whole prompt. Then MXFP4: the decoding against the spec's table worked by hand, and a checkpoint
re-encoded to MXFP4 against its float twin (and transformers' own reading)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_lanes import open_lane
from hf_reference import check_against_transformers, check_chunks_equal_whole, engine_of
from multiproc import RankPool
from mxfp4_models import write_mxfp4_pair
from test_tp_exact import PROMPTS, check_tp2_equals_tp1_and_batched_equals_solo, run_streams
from tiny_hf_models import write_hf_model
from tiny_models import BASE

from tpserve.kernels.linear import ROW_TILE
from tpserve.kernels.mxfp4_linear import Mxfp4Weight
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import parse_model_config
from tpserve.ranks.mxfp4 import dequantize_mxfp4

transformers = pytest.importorskip("transformers")

# The OCP MX spec's e2m1 (sign, 2 exponent bits of bias 1, 1 mantissa bit), code by code, by hand:
# 0b0000 +0, 0b0001 subnormal 0.5, 0b0010 2^0 * 1.0, 0b0011 2^0 * 1.5, 0b0100 2^1 * 1.0, ...
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("row_tile", [0, ROW_TILE], ids=["plain", "batch-invariant"])
def test_gpt_oss_matches_transformers(tmp_path, row_tile):
    check_against_transformers(write_hf_model(tmp_path / "gpt-oss", "gpt-oss"), row_tile)


def test_a_gpt_oss_prompt_in_chunks_has_the_whole_prompts_logits(tmp_path):
    check_chunks_equal_whole(write_hf_model(tmp_path / "gpt-oss", "gpt-oss"), 13)


def test_gpt_oss_tp2_equals_tp1_and_batched_equals_solo(pool, tmp_path):
    model_dir = str(write_hf_model(tmp_path / "gpt-oss", "gpt-oss"))
    check_tp2_equals_tp1_and_batched_equals_solo(pool, model_dir, "none")


def test_int4_gpt_oss_experts_tp2_equal_tp1_and_batched_equals_solo(pool, tmp_path):
    # every expert's slices (and the attention's) in 4-bit blocks, the biases beside them in float
    model_dir = str(write_hf_model(tmp_path / "gpt-oss", "gpt-oss", intermediate_size=64))
    check_tp2_equals_tp1_and_batched_equals_solo(pool, model_dir, "int4")


def test_mxfp4_decodes_every_code_and_scale_as_the_spec_says():
    # byte 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) element 1; 0xFE: -4, -6
    codes = torch.tensor(
        [lo | (hi << 4) for lo, hi in zip(range(0, 16, 2), range(1, 16, 2))] * 2, dtype=torch.uint8
    )
    scales = torch.tensor([[127], [128], [0], [252]], dtype=torch.uint8)  # 2^0, 2^1, 2^-127, 2^125
    blocks = codes.view(1, 1, 16).expand(4, 1, 16).contiguous()
    values = dequantize_mxfp4(blocks, scales, torch.float32, "test")
    assert values.shape == (4, 32)
    expected = torch.tensor(E2M1 * 2)
    assert values[0].tolist() == expected.tolist() and torch.equal(values[0].signbit(), expected.signbit())
    assert values[1].tolist() == (expected * 2).tolist()
    assert values[2, 1].item() == 2.0**-128 and values[2, 7].item() == 6 * 2.0**-127  # subnormal, exact
    assert values[3, 7].item() == 6 * 2.0**125  # the largest that float32 holds


def test_mxfp4_values_a_dtype_cannot_hold_exactly_are_refused():
    blocks = torch.full((1, 1, 16), 0x77, dtype=torch.uint8)  # every value 6
    with pytest.raises(ModelFileError, match="out of torch.float16's exact range"):
        dequantize_mxfp4(blocks, torch.tensor([[127 + 14]], dtype=torch.uint8), torch.float16, "w")
    assert (
        dequantize_mxfp4(blocks, torch.tensor([[127 + 13]], dtype=torch.uint8), torch.float16, "w")[0, 0]
        == 6 * 2**13
    )
    with pytest.raises(ModelFileError, match="out of torch.float32's exact range"):  # 6 * 2^127
        dequantize_mxfp4(blocks, torch.tensor([[254]], dtype=torch.uint8), torch.float32, "w")
    with pytest.raises(ModelFileError, match="NaN"):
        dequantize_mxfp4(blocks, torch.tensor([[255]], dtype=torch.uint8), torch.float32, "w")


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    # experts 96 wide: a piece's 48 columns of down cut a block of 32 in two
    out = tmp_path_factory.mktemp("mxfp4")
    return write_mxfp4_pair(write_hf_model(out / "source", "gpt-oss", intermediate_size=96), out)


def test_an_mxfp4_checkpoint_has_its_float_twins_logits_bit_for_bit(mxfp4_pair):
    torch.set_num_threads(1)
    mxfp4, twin = (str(d) for d in mxfp4_pair)
    assert (
        parse_model_config(json.loads((mxfp4_pair[0] / "config.json").read_text())).quantization.method
        == "mxfp4"
    )
    packed_logits, packed_tokens = run_streams(mxfp4, 0, 1)
    twin_logits, twin_tokens = run_streams(twin, 0, 1)
    assert packed_tokens == twin_tokens and torch.equal(packed_logits, twin_logits)


def test_transformers_reads_our_mxfp4_checkpoint_to_our_logits(mxfp4_pair):
    # transformers decodes the blocks itself (on a CPU, to float): the layout is its own
    torch.set_num_threads(1)
    ids = PROMPTS[1]
    engine = engine_of(mxfp4_pair[0], ROW_TILE)
    open_lane(engine, 0, len(ids))
    ours = engine.forward([(0, 0, ids)])[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_pair[0], dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_int4_serves_mxfp4_experts_as_stored_in_mxfp4_blocks(mxfp4_pair):
    # nothing rounded twice: every expert's gate/up blocks hold exactly the twin's float values
    # (the down pieces, 48 columns, are off the block edges here: served from their values)
    mxfp4, twin = (
        load_rank_model(d, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=256, quantize=q)
        for d, q in zip(mxfp4_pair, ("int4", "none"))
    )
    for packed, plain in zip(mxfp4.layers, twin.layers):
        for piece, float_piece in zip(packed.mlp.pieces, plain.mlp.pieces):
            for gate_up, float_gate_up in zip(piece.gate_ups, float_piece.gate_ups):
                assert isinstance(gate_up, Mxfp4Weight)
                assert torch.equal(gate_up.dequantize(), float_gate_up)


@pytest.mark.parametrize("quantize", ["none", "int4"])  # int4: the gate/up pieces in MXFP4 blocks
def test_mxfp4_experts_tp2_equal_tp1_and_batched_equals_solo(pool, mxfp4_pair, quantize):
    check_tp2_equals_tp1_and_batched_equals_solo(pool, str(mxfp4_pair[0]), quantize)


def test_a_gpt_oss_20b_config_reads_its_layers_experts_and_rope():
    raw = {
        **BASE,
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 320,
        "num_hidden_layers": 4,
        "head_dim": 64,
        "attention_bias": True,
        "num_local_experts": 32,
        "experts_per_token": 4,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
    }
    config = parse_model_config(raw)
    assert config.family == "gpt_oss" and config.windows == (128, 0, 128, 0)
    assert config.sinks and config.o_bias and config.qkv_bias
    moe = config.moe
    assert (
        moe.num_experts == 32
        and moe.num_experts_per_tok == 4
        and moe.expert_size == BASE["intermediate_size"]
    )
    assert (
        moe.biased
        and moe.stacked
        and moe.softmax_top_logits
        and (moe.swiglu.alpha, moe.swiglu.limit) == (1.702, 7.0)
    )
    assert config.rope_theta == 150000 and config.rope_scaling.rope_type == "yarn"
    assert not config.rope_scaling.truncate and config.rope_scaling.factor == 32.0
    with pytest.raises(ModelFileError, match="yarn's mscale 1.0 is not implemented"):
        parse_model_config(raw | {"rope_scaling": raw["rope_scaling"] | {"mscale": 1.0}})

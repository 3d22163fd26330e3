"""`import-gguf` of mixtures of experts (qwen3moe, qwen2moe, gpt-oss, glm4moe): tiny models transformers writes itself,
converted to GGUF as llama.cpp's converter writes them (tests/hf_to_gguf.py), imported, and served
against transformers' forward of the same model."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hf_reference import check_against_transformers
from hf_to_gguf import write_gguf, write_reference
from multiproc import RankPool
from safetensors.numpy import load_file, save_file
from test_gguf_import import RANDOM_BLOCKS
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo
from tiny_hf_models import write_hf_model
from tokenizers import Tokenizer

from tpserve.gguf_blocks import read_mxfp4
from tpserve.gguf_import import import_gguf, rotary_factor
from tpserve.kernels.linear import ROW_TILE
from tpserve.kernels.mxfp4_linear import Mxfp4Weight
from tpserve.ranks.block_tensors import MXFP4
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import load_model_config

Q = gguf.GGMLQuantizationType


def imported(
    tmp_path: Path,
    family: str,
    expert_type: Q = Q.F32,
    random_blocks=None,
    layer_type: Q = Q.F32,
    **overrides,
) -> tuple[Path, Path]:
    """(the import's model directory, the transformers checkpoint of the model its GGUF holds)."""
    hf_dir = write_hf_model(tmp_path / "hf", family, **overrides)
    tensors = write_gguf(hf_dir, tmp_path / "model.gguf", expert_type, random_blocks, layer_type)
    reference = write_reference(hf_dir, tmp_path / "reference", tensors)
    return import_gguf(tmp_path / "model.gguf", tmp_path / "imported", progress=False), reference


def test_qwen3moe_float_import_matches_transformers(tmp_path):
    out_dir, reference = imported(tmp_path, "qwen3-moe")
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 8, 3)
    assert config["moe_intermediate_size"] == 18 and config["mlp_only_layers"] == [1]
    moe = load_model_config(out_dir).moe
    assert moe.sparse_layers == (0, 2) and moe.normalize_top_k
    weights = load_file(str(out_dir / "model.safetensors"))
    hf = load_file(str(reference / "model.safetensors"))
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    np.testing.assert_array_equal(weights[name], hf[name])
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


def test_qwen2moe_shared_expert_and_its_gate_import_and_match_transformers(tmp_path):
    out_dir, reference = imported(tmp_path, "qwen2-moe", Q.Q8_0, moe_intermediate_size=32)
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["model_type"], config["shared_expert_intermediate_size"]) == ("qwen2_moe", 20)
    assert config["mlp_only_layers"] == [1] and not config["norm_topk_prob"] and config["qkv_bias"]
    weights = load_file(str(out_dir / "model.safetensors"))
    assert weights["model.layers.2.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert "model.layers.0.mlp.experts.4.up_proj.weight_q8" in weights
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


def test_glm4moe_import_skips_its_mtp_layer_and_matches_transformers(tmp_path):
    out_dir, reference = imported(tmp_path, "glm4-moe", Q.Q8_0, moe_intermediate_size=32)
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["first_k_dense_replace"]) == (
        "glm4_moe",
        3,
        1,
    )
    assert (config["n_group"], config["topk_group"], config["routed_scaling_factor"]) == (4, 2, 2.5)
    assert config["partial_rotary_factor"] == 0.5 and config["use_qk_norm"] and config["attention_bias"]
    weights = load_file(str(out_dir / "model.safetensors"))
    hf = load_file(str(reference / "model.safetensors"))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    np.testing.assert_array_equal(weights[name], hf[name])
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in weights
    assert not any(name.startswith("model.layers.3.") for name in weights)  # the MTP layer's
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


def test_glm4moe_softmax_gating_is_refused_by_name(tmp_path):
    write_gguf(write_hf_model(tmp_path / "hf", "glm4-moe"), tmp_path / "model.gguf")
    reader = gguf.GGUFReader(tmp_path / "model.gguf", "r+")
    field = reader.fields["glm4moe.expert_gating_func"]
    field.parts[field.data[0]][0] = gguf.ExpertGatingFuncType.SOFTMAX
    reader.data.flush()
    with pytest.raises(ModelFileError, match="expert_gating_func 1 is not sigmoid"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "imported", progress=False)


@pytest.mark.parametrize("expert_type", [Q.Q8_0, Q.Q4_0], ids=["q8_0", "q4_0"])
def test_qwen3moe_quantized_experts_stay_in_blocks_and_match_transformers(tmp_path, expert_type):
    out_dir, reference = imported(tmp_path, "qwen3-moe", expert_type, moe_intermediate_size=32)
    weights = load_file(str(out_dir / "model.safetensors"))
    bits = 8 if expert_type == Q.Q8_0 else 4
    stem = "model.layers.0.mlp.experts.3."
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"{stem}{proj}.weight_q{bits}" in weights and f"{stem}{proj}.weight" not in weights
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


@pytest.mark.parametrize("expert_type", [Q.Q4_K, Q.Q6_K], ids=["q4_k", "q6_k"])
def test_qwen3moe_k_quant_experts_stay_in_blocks_and_match_transformers(tmp_path, expert_type):
    rng = np.random.default_rng(0)

    def random_blocks(shape, qtype):  # [E, out, in] -> raw super-blocks [E, out, bytes]
        return RANDOM_BLOCKS[qtype](shape[0] * shape[1], shape[2], rng).reshape(shape[0], shape[1], -1)

    sizes = {"hidden_size": 256, "moe_intermediate_size": 256}
    out_dir, reference = imported(tmp_path, "qwen3-moe", expert_type, random_blocks, **sizes)
    weights = load_file(str(out_dir / "model.safetensors"))
    suffix = "_q4" if expert_type == Q.Q4_K else "_q6"
    assert "model.layers.2.mlp.experts.7.down_proj.weight" + suffix in weights
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


def test_mixtral_written_as_llama_with_experts_imports_unpermuted_and_matches_transformers(tmp_path):
    out_dir, reference = imported(tmp_path, "mixtral", Q.Q8_0, intermediate_size=32)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 8
    weights = load_file(str(out_dir / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.6.w2.weight_q8" in weights
    name = "model.layers.1.self_attn.k_proj.weight"  # float32: its permutation undone exactly
    np.testing.assert_array_equal(weights[name], load_file(str(reference / "model.safetensors"))[name])
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


def test_gpt_oss_float_import_matches_transformers(tmp_path):
    out_dir, reference = imported(tmp_path, "gpt-oss")
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["sliding_window"] == 8
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


def test_gpt_oss_mxfp4_experts_keep_their_codes_and_scales_and_match_transformers(tmp_path):
    out_dir, reference = imported(tmp_path, "gpt-oss", Q.MXFP4, intermediate_size=32)
    weights = load_file(str(out_dir / "model.safetensors"))
    stem = "model.layers.1.mlp.experts.2."
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"{stem}{proj}.weight_mxfp4" in weights and f"{stem}{proj}.weight" not in weights
    assert weights[f"{stem}gate_proj.weight_e8m0"].dtype == np.uint8
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)
    served = load_rank_model(
        out_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64, quantize="int4"
    )
    assert all(isinstance(g, Mxfp4Weight) for piece in served.layers[1].mlp.pieces for g in piece.gate_ups)
    weights[f"{stem}up_proj.weight_e8m0"][3, 0] = 255  # a NaN scale, written after the import
    save_file(weights, str(out_dir / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"up_proj.weight_e8m0 holds a NaN MXFP4 scale \(255\)"):
        load_rank_model(out_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64, quantize="int4")


def test_gpt_oss_o200k_pre_tokenizer_splits_as_llama_cpp_does(tmp_path):
    hf_dir = write_hf_model(tmp_path / "hf", "gpt-oss")
    write_gguf(hf_dir, tmp_path / "model.gguf", pre="gpt-4o")
    out_dir = import_gguf(tmp_path / "model.gguf", tmp_path / "imported", progress=False)
    pre_tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json")).pre_tokenizer
    pieces = [piece for piece, _ in pre_tokenizer.pre_tokenize_str("HelloWorld's 12345")]
    assert pieces == ["Hello", "World's", "Ġ", "123", "45"]


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "deepseek2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="architecture 'deepseek2' is not supported"):
        import_gguf(tmp_path / "other.gguf", tmp_path / "out", progress=False)


def test_gemma3_import_takes_the_norms_one_off_and_matches_transformers(tmp_path):
    # llama.cpp scales q.k by head_dim^-1/2 on every gemma3 but the 27B: a model it can describe
    out_dir, reference = imported(tmp_path, "gemma3", query_pre_attn_scalar=16)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["final_logit_softcapping"] == 30.0
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and config["rope_theta"] == 1e6
    weights = load_file(str(out_dir / "model.safetensors"))
    hf = load_file(str(reference / "model.safetensors"))
    name = "model.layers.1.post_feedforward_layernorm.weight"
    np.testing.assert_allclose(weights[name], hf[name], rtol=0, atol=2.0**-23)
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


@pytest.mark.parametrize("variant", ["phi3", "phi3-longrope", "phi4-mini"])
def test_phi3_fused_weights_and_longrope_factors_match_transformers(tmp_path, variant):
    out_dir, reference = imported(tmp_path, variant)
    config = json.loads((out_dir / "config.json").read_text())
    weights = load_file(str(out_dir / "model.safetensors"))
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in weights
        and "model.layers.0.mlp.gate_up_proj.weight" in weights
    )
    if variant == "phi3-longrope":
        assert config["rope_scaling"]["short_factor"] == [1.0 + 0.25 * i for i in range(8)]
        assert config["original_max_position_embeddings"] == 256
    if variant == "phi4-mini":  # rope.dimension_count 12 of 16, the longrope factors for those 12
        assert config["partial_rotary_factor"] == 0.75 and len(config["rope_scaling"]["short_factor"]) == 6
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


def test_a_rotary_dimension_count_becomes_a_factor_transformers_counts_back():
    # 30 / 44 * 44 is 29.999999999999996: int() would count 29 dims
    for rotary_dim, head_dim in ((30, 44), (12, 16), (96, 128), (6, 47)):
        assert int(head_dim * rotary_factor(rotary_dim, head_dim)) == rotary_dim


@pytest.mark.parametrize("variant", ["phi3", "phi4-mini"])
def test_phi3_fused_weights_in_blocks_are_split_on_load(tmp_path, variant):
    # (Phi-4-mini's: q's and k's rows reordered for its partial rotary, blocks and scales alike)
    out_dir, reference = imported(tmp_path, variant, layer_type=Q.Q8_0)
    weights = load_file(str(out_dir / "model.safetensors"))
    assert "model.layers.1.self_attn.qkv_proj.weight_q8" in weights
    assert "model.layers.1.mlp.gate_up_proj.weight_q8" in weights
    check_against_transformers(out_dir, ROW_TILE, reference_dir=reference)


@pytest.mark.parametrize(
    ("family", "expert_type", "sizes"),
    [
        ("qwen3-moe", Q.Q4_0, {"moe_intermediate_size": 64}),
        ("qwen2-moe", Q.Q4_0, {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}),
        ("gpt-oss", Q.MXFP4, {"intermediate_size": 64}),
        ("glm4-moe", Q.Q4_0, {"moe_intermediate_size": 64, "intermediate_size": 128}),
    ],
    ids=["qwen3moe-q4_0", "qwen2moe-q4_0", "gpt-oss-mxfp4", "glm4moe-q4_0"],
)
def test_imported_experts_in_blocks_tp2_equal_tp1_and_batched_equals_solo(
    tmp_path, family, expert_type, sizes
):
    # served as stored (int4), each piece's 32 of every expert's intermediate columns its own blocks
    out_dir, _ = imported(tmp_path, family, expert_type, **sizes)
    with RankPool(2) as pool:
        check_tp2_equals_tp1_and_batched_equals_solo(pool, str(out_dir), "int4")


def test_mxfp4_blocks_hold_what_gguf_dequantizes_and_a_nan_scale_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    raw = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.MXFP4)  # [4, 2 * 17]
    blocks = read_mxfp4(raw, 4, 64)
    assert blocks.bits == MXFP4 and blocks.d.dtype == np.uint8 and int(blocks.q.max()) <= 15
    np.testing.assert_array_equal(blocks.dequantize(), gguf.quants.dequantize(raw, Q.MXFP4))
    hf_dir = write_hf_model(tmp_path / "hf", "gpt-oss", intermediate_size=32)
    write_gguf(hf_dir, tmp_path / "model.gguf", Q.MXFP4)
    reader = gguf.GGUFReader(tmp_path / "model.gguf", "r+")
    stored = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    stored.data[1, 5, 17] = 255  # expert 1, row 5: its second block's scale
    reader.data.flush()
    with pytest.raises(ModelFileError, match="blk.0.ffn_up_exps.weight has a NaN MXFP4 scale"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "imported", progress=False)

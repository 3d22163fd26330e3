"""GGUF's Q6_K (and Q3_K, in the same form) kept in its own blocks (tpserve/gguf_blocks.py): read exactly
as the `gguf` package dequantizes it, imported as 6-bit values with their sub-scales, read per rank,
served as the file holds it by int4 (the head and a tied embedding included), refused by name where
damaged."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from multiproc import RankPool
from safetensors.numpy import load_file
from served_pieces import piece_weight
from test_gguf_import import (
    LLAMA_TYPES,
    RANDOM_BLOCKS,
    _logits,
    assert_damage_refused,
    assert_weights_match,
    random_q6_k,
    write_tiny_gguf,
)
from test_gguf_kquants import K_FFN, K_HIDDEN, K_LAYERS, _bits, expected_pieces
from test_tp_exact import PROMPTS, SAMPLINGS, _tp2, run_streams

from tpserve.gguf_blocks import read_blocks
from tpserve.gguf_import import import_gguf
from tpserve.kernels.q4_linear import Q4Weight
from tpserve.kernels.q6_linear import Q6Weight, q6_available
from tpserve.kernels.stacked_weight import StackedWeight
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.sharding import split_evenly

Q = gguf.GGMLQuantizationType
# As a Q4_K_M file: attn_v, ffn_down, the (tied) embedding and head in Q6_K, the rest in Q4_K.
Q4_K_M = dict.fromkeys(K_LAYERS, Q.Q4_K) | {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K}
ALL_Q6_K = dict.fromkeys((*K_LAYERS, "token_embd"), Q.Q6_K)
Q5_K_M = Q4_K_M | dict.fromkeys(("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"), Q.Q5_K)
ALL_Q3_K = dict.fromkeys((*K_LAYERS, "token_embd"), Q.Q3_K)
needs_kernel = pytest.mark.skipif(q6_available() is not None, reason=str(q6_available()))


def test_q6_k_blocks_dequantize_to_the_gguf_packages_bits():
    rng = np.random.default_rng(6)
    raw = random_q6_k(5, 512, rng)
    supers = raw.reshape(5, 2, 210)
    # Edge super-blocks: the largest float16 d with every sc -128, a subnormal d, zero, -0.
    for row, d in enumerate([65504.0, 2.0**-24, 0.0, -0.0]):
        supers[row, 0, 208:] = np.array([d], dtype=np.float16).view(np.uint8)
    supers[0, 0, 192:208] = 0x80
    blocks = read_blocks(raw, Q.Q6_K, (5, 512))
    assert blocks.q.dtype == np.uint8 and blocks.q.shape == (5, 512) and int(blocks.q.max()) == 63
    assert blocks.sc.dtype == np.int8 and blocks.sc.shape == (5, 32)
    assert blocks.d.dtype == np.float16 and blocks.d.shape == (5, 2)
    assert np.array_equal(_bits(blocks.dequantize()), _bits(gguf.quants.dequantize(raw, Q.Q6_K)))


def test_q3_k_blocks_read_as_six_bit_blocks_dequantize_to_the_gguf_packages_bits():
    rng = np.random.default_rng(8)
    raw = RANDOM_BLOCKS[Q.Q3_K](5, 512, rng)
    supers = raw.reshape(5, 2, 110)
    supers[0, 0, :108] = 0  # every value -4, every scale -32: the extremes
    supers[1, 0, :108] = 0xFF  # every value 3, every scale 31
    blocks = read_blocks(raw, Q.Q3_K, (5, 512))
    assert blocks.q.dtype == np.uint8 and (int(blocks.q.min()), int(blocks.q.max())) == (28, 35)
    assert blocks.sc.dtype == np.int8 and (int(blocks.sc.min()), int(blocks.sc.max())) == (-32, 31)
    assert np.array_equal(_bits(blocks.dequantize()), _bits(gguf.quants.dequantize(raw, Q.Q3_K)))


def _model(tmp_path: Path, types: dict, name: str = "model") -> tuple[Path, dict[str, np.ndarray]]:
    originals = write_tiny_gguf(tmp_path / f"{name}.gguf", types=types, hidden=K_HIDDEN, ffn=K_FFN)
    out_dir = import_gguf(tmp_path / f"{name}.gguf", tmp_path / name, progress=False)
    assert_weights_match(out_dir, originals, LLAMA_TYPES | types)  # exact for Q4_K and Q6_K
    return out_dir, originals


def test_q6_k_layers_import_as_6_bit_values_sub_scales_and_super_block_scales(tmp_path: Path):
    out_dir, _ = _model(tmp_path, ALL_Q6_K)
    stored = load_file(str(out_dir / "model.safetensors"))
    down = "model.layers.0.mlp.down_proj.weight"
    assert stored[down + "_q6"].dtype == np.uint8 and stored[down + "_q6"].shape == (K_HIDDEN, K_FFN)
    assert stored[down + "_sc"].dtype == np.int8 and stored[down + "_sc"].shape == (K_HIDDEN, K_FFN // 16)
    assert stored[down + "_d"].dtype == np.float16 and stored[down + "_d"].shape == (K_HIDDEN, K_FFN // 256)
    # 1.07 bytes a weight on disk (the GGUF: 0.82), against float32's 4.
    assert stored[down + "_q6"].nbytes + stored[down + "_sc"].nbytes + stored[down + "_d"].nbytes == (
        K_HIDDEN * K_FFN * (1 + 1 / 16 + 2 / 256)
    )


@needs_kernel
@pytest.mark.parametrize("types", [Q4_K_M, ALL_Q6_K, ALL_Q3_K], ids=["q4_k_m", "all-q6_k", "all-q3_k"])
@pytest.mark.parametrize("tp_rank, tp_size", [(0, 1), (1, 2)])
def test_int4_serves_the_q6_k_files_own_values(tmp_path: Path, tp_rank, tp_size, types):
    # Row-parallel pieces of 128 inputs start on block edges inside a super-block (its d read out
    # to each block of 32). A Q4_K_M's q/k/v is its Q4_K q and k and its Q6_K v, stacked.
    out_dir, originals = _model(tmp_path, types)
    model = load_rank_model(
        out_dir, tp_rank=tp_rank, tp_size=tp_size, dtype=torch.float32, max_positions=64, quantize="int4"
    )
    served_as = {"w_qkv": Q6Weight, "w_o": Q6Weight, "w_gate_up": Q6Weight, "w_down": Q6Weight}
    if types is Q4_K_M:
        served_as |= {"w_qkv": StackedWeight, "w_o": Q4Weight, "w_gate_up": Q4Weight}
    for index, expected in enumerate(expected_pieces(model, originals, tp_rank, tp_size)):
        for name, values in expected.items():
            served = piece_weight(model.layers[0], index, name)
            assert isinstance(served, served_as[name]), name
            assert torch.equal(served.dequantize(), values), f"piece {index}'s {name}"
    # The tied head is the Q6_K embedding as stored, and the embedding reads the head's rows.
    vocab = torch.from_numpy(originals["model.embed_tokens.weight"])
    start = split_evenly(model.config.vocab_size, tp_size)[tp_rank][0]
    for head in model.lm_head.weights:
        assert isinstance(head, Q6Weight)
        assert torch.equal(head.dequantize(), vocab[start : start + head.shape[0]])
        start += head.shape[0]
    assert model.embed_tokens.tables is model.lm_head.weights


@needs_kernel
def test_int8_and_none_serve_the_exact_values_as_a_float32_import_does(tmp_path: Path):
    blocks, _ = _model(tmp_path, Q4_K_M)
    floats = import_gguf(tmp_path / "model.gguf", tmp_path / "floats", progress=False, dequantize=True)
    torch.set_num_threads(1)
    for quantize in ("none", "int8"):
        assert torch.equal(_logits(blocks, quantize), _logits(floats, quantize)), quantize
    logits = _logits(blocks, "int4")
    assert torch.isfinite(logits).all() and torch.equal(logits, _logits(blocks, "int4"))


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@needs_kernel
@pytest.mark.parametrize("types", [Q4_K_M, Q5_K_M, ALL_Q6_K], ids=["q4_k_m", "q5_k_m", "all-q6_k"])
def test_a_q6_k_model_gives_tp2_the_logits_of_tp1_and_a_batch_those_of_solo_runs(pool, tmp_path, types):
    out_dir = str(_model(tmp_path, types)[0])
    torch.set_num_threads(1)
    together, tokens = run_streams(out_dir, 0, 1, quantize="int4")
    pair_logits, pair_tokens = pool.run(_tp2, out_dir, "float32", "gloo", "int4", timeout_s=120)[0]
    assert pair_tokens == tokens and torch.equal(pair_logits, together)
    for lane, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        alone, _ = run_streams(out_dir, 0, 1, prompts=[prompt], samplings=[sampling], quantize="int4")
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda t: t.pop(DOWN + "_sc"), r"down_proj.weight_q6 has no .*down_proj.weight_sc"),
        (lambda t: t.update({DOWN + "_q6": t[DOWN + "_q6"].view(np.int8)}), r"weight_q6 is I8 .* need U8"),
        (lambda t: t.update({DOWN + "_sc": t[DOWN + "_sc"].view(np.uint8)}), r"weight_sc is U8 .* not I8"),
        (lambda t: t.update({DOWN + "_d": t[DOWN + "_d"].astype(np.float32)}), r"weight_d is F32 .* not F16"),
        (lambda t: t[DOWN + "_d"].__setitem__((3, 1), np.inf), r"down_proj.weight's block scales"),
        (lambda t: t[DOWN + "_q6"].__setitem__((0, 3), 64), r"down_proj.weight_q6 holds 64, past 6 bits"),
    ],
    ids=["no-sc", "signed-values", "unsigned-sc", "float32-d", "infinite-d", "past-63"],
)
def test_a_damaged_q6_k_tensor_is_refused_by_name(tmp_path: Path, damage, message):
    assert_damage_refused(_model(tmp_path, ALL_Q6_K)[0], damage, message)

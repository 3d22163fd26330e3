"""GGUF's Q4_K and Q5_K (and Q5_0, Q5_1) kept in their own blocks of 32 (tpserve/gguf_blocks.py): read
exactly as the `gguf` package dequantizes them, imported with float32 block scales (K-quants), and
served by int4 as the file holds them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from served_pieces import piece_weight
from test_gguf_import import (
    LLAMA_TYPES,
    _logits,
    assert_weights_match,
    random_q4_k,
    random_q5_k,
    write_tiny_gguf,
)

from tpserve.gguf_blocks import read_blocks
from tpserve.gguf_import import import_gguf
from tpserve.kernels.q4_linear import q4_available
from tpserve.kernels.q5_linear import Q5Weight, q5_available
from tpserve.ranks.loader import load_rank_model

Q = gguf.GGMLQuantizationType
K_HIDDEN, K_FFN = 256, 512  # K-quants pack rows in super-blocks of 256 inputs
K_LAYERS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def test_q4_k_blocks_dequantize_to_the_gguf_packages_bits():
    rng = np.random.default_rng(5)
    raw = random_q4_k(6, 512, rng)
    # Edge super-blocks: the largest float16 d with every sc 63, a subnormal d and dmin, zeros, -0.
    for row, (d, dmin) in enumerate([(65504.0, 1.0), (2.0**-24, -(2.0**-20)), (0.0, 0.0), (-0.0, 3.5)]):
        raw[row, :4] = np.array([d, dmin], dtype=np.float16).view(np.uint8)
    raw[0, 4:16] = 0xFF
    blocks = read_blocks(raw, Q.Q4_K, (6, 512))
    assert blocks.q.dtype == np.uint8 and blocks.q.shape == (6, 512) and int(blocks.q.max()) <= 15
    assert blocks.d.dtype == blocks.m.dtype == np.float32 and blocks.d.shape == (6, 16)
    assert np.array_equal(_bits(blocks.dequantize()), _bits(gguf.quants.dequantize(raw, Q.Q4_K)))
    # Why float32: d * sc is often not a float16.
    assert (torch.from_numpy(blocks.d).half().float().numpy() != blocks.d).any()


def _q4_k_model(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    types = dict.fromkeys(K_LAYERS, Q.Q4_K)
    originals = write_tiny_gguf(tmp_path / "tiny.gguf", types=types, hidden=K_HIDDEN, ffn=K_FFN)
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    assert_weights_match(out_dir, originals, LLAMA_TYPES | types)  # exact for Q4_K
    return out_dir, originals


def test_q4_k_layers_import_as_4_bit_blocks_with_float32_scales(tmp_path: Path):
    out_dir, _ = _q4_k_model(tmp_path)
    stored = load_file(str(out_dir / "model.safetensors"))
    up = "model.layers.0.mlp.up_proj.weight"
    assert stored[up + "_q4"].dtype == np.uint8 and stored[up + "_q4"].shape == (K_FFN, K_HIDDEN)
    assert stored[up + "_d"].dtype == stored[up + "_m"].dtype == np.float32
    assert stored[up + "_d"].shape == (K_FFN, K_HIDDEN // 32)


def expected_pieces(model, originals: dict[str, np.ndarray], tp_rank: int, tp_size: int) -> list[dict]:
    """Layer 0's fused and sliced weights each piece of `model` (rank tp_rank of tp_size) should serve,
    taken from the original float weights."""
    pieces = model.pieces
    head_dim, num_kv = model.config.head_dim, model.config.num_kv_heads
    kv_per_piece = num_kv // (tp_size * len(pieces))
    q_per_piece = kv_per_piece * model.config.num_queries_per_kv
    ffn_per_piece = K_FFN // (tp_size * len(pieces))
    weights = {name: torch.from_numpy(array) for name, array in originals.items()}
    w = {part: weights[f"model.layers.0.{name}.weight"] for part, name in (
        ("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
        ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"),
    )}  # fmt: skip
    expected = []
    for index in range(len(pieces)):
        at = tp_rank * len(pieces) + index  # the piece's place among all pieces
        q_rows = slice(at * q_per_piece * head_dim, (at + 1) * q_per_piece * head_dim)
        kv_rows = slice(at * kv_per_piece * head_dim, (at + 1) * kv_per_piece * head_dim)
        ffn = slice(at * ffn_per_piece, (at + 1) * ffn_per_piece)
        expected.append({
            "w_qkv": torch.cat([w["q"][q_rows], w["k"][kv_rows], w["v"][kv_rows]]),
            "w_o": w["o"][:, q_rows],
            "w_gate_up": torch.cat([w["gate"][ffn], w["up"][ffn]]),
            "w_down": w["down"][:, ffn],
        })  # fmt: skip
    return expected


@pytest.mark.skipif(q4_available() is not None, reason=str(q4_available()))
@pytest.mark.parametrize("tp_rank, tp_size", [(0, 1), (1, 2)])
def test_int4_serves_the_q4_k_files_own_values(tmp_path: Path, tp_rank, tp_size):
    out_dir, originals = _q4_k_model(tmp_path)
    model = load_rank_model(
        out_dir, tp_rank=tp_rank, tp_size=tp_size, dtype=torch.float32, max_positions=64, quantize="int4"
    )
    for index, expected in enumerate(expected_pieces(model, originals, tp_rank, tp_size)):
        for name, values in expected.items():
            served = piece_weight(model.layers[0], index, name)
            assert served.scale_dtype == torch.float32, name
            assert torch.equal(served.dequantize(), values), f"piece {index}'s {name}"
    if tp_size == 1:
        torch.set_num_threads(1)
        logits = _logits(out_dir, "int4")
        assert torch.isfinite(logits).all() and torch.equal(logits, _logits(out_dir, "int4"))


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q5_0, Q.Q5_1])
def test_q5_blocks_dequantize_to_the_gguf_packages_bits(qtype):
    rng = np.random.default_rng(7)
    if qtype == Q.Q5_K:
        raw = random_q5_k(6, 512, rng)
    else:  # random bits with sane float16 d (and m)
        raw = rng.integers(0, 256, (6, 16, 22 if qtype == Q.Q5_0 else 24), dtype=np.uint8)
        scales = (rng.uniform(-2, 2, (6, 16, 2)) / 64).astype(np.float16)
        raw[..., : 2 * (1 + (qtype == Q.Q5_1))] = scales[..., : 1 + (qtype == Q.Q5_1)].view(np.uint8)
        raw = raw.reshape(6, -1)
    blocks = read_blocks(raw, qtype, (6, 512))
    assert blocks.bits == 5 and blocks.q.dtype == np.uint8 and int(blocks.q.max()) == 31
    assert blocks.d.dtype == (np.float32 if qtype == Q.Q5_K else np.float16)
    expected = gguf.quants.dequantize(raw, qtype)
    if qtype == Q.Q5_0:  # d * (q - 16) is -0.0 where d < 0 and q = 16; d * q + (-16 d) is +0.0
        expected = expected + np.float32(0.0)
    assert np.array_equal(_bits(blocks.dequantize()), _bits(expected))


@pytest.mark.skipif(q5_available() is not None, reason=str(q5_available()))
@pytest.mark.parametrize("tp_rank, tp_size", [(0, 1), (1, 2)])
def test_int4_serves_the_q5_k_files_own_values(tmp_path: Path, tp_rank, tp_size):
    types = dict.fromkeys(K_LAYERS, Q.Q5_K)
    originals = write_tiny_gguf(tmp_path / "tiny.gguf", types=types, hidden=K_HIDDEN, ffn=K_FFN)
    out_dir = import_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    assert_weights_match(out_dir, originals, LLAMA_TYPES | types)  # exact for Q5_K
    stored = load_file(str(out_dir / "model.safetensors"))
    up = "model.layers.0.mlp.up_proj.weight"
    assert stored[up + "_q5"].dtype == np.uint8 and stored[up + "_d"].dtype == np.float32
    model = load_rank_model(
        out_dir, tp_rank=tp_rank, tp_size=tp_size, dtype=torch.float32, max_positions=64, quantize="int4"
    )
    for index, expected in enumerate(expected_pieces(model, originals, tp_rank, tp_size)):
        for name, values in expected.items():
            served = piece_weight(model.layers[0], index, name)
            assert isinstance(served, Q5Weight) and served.scale_dtype == torch.float32, name
            assert torch.equal(served.dequantize(), values), f"piece {index}'s {name}"


@pytest.mark.skipif(q5_available() is not None, reason=str(q5_available()))
def test_q5_0_and_q5_1_layers_are_served_as_stored_and_as_a_float_import_in_int8_and_none(tmp_path: Path):
    types = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "attn_output": Q.Q5_1}
    types |= {"ffn_gate": Q.Q5_1, "ffn_up": Q.Q5_1, "ffn_down": Q.Q5_0}
    originals = write_tiny_gguf(tmp_path / "tiny.gguf", types=types)
    blocks = import_gguf(tmp_path / "tiny.gguf", tmp_path / "blocks", progress=False)
    floats = import_gguf(tmp_path / "tiny.gguf", tmp_path / "floats", progress=False, dequantize=True)
    assert_weights_match(blocks, originals, LLAMA_TYPES | types)
    torch.set_num_threads(1)
    for quantize in ("none", "int8"):
        assert torch.equal(_logits(blocks, quantize), _logits(floats, quantize)), quantize
    model = load_rank_model(
        blocks, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64, quantize="int4"
    )
    # gate/up's rows are whole blocks (this tiny model's row-parallel pieces are not: they fall back)
    gate_up = model.layers[1].mlp.pieces[0].w_gate_up
    assert isinstance(gate_up, Q5Weight) and gate_up.scale_dtype == torch.float16

"""Mixtures of experts in compressed-tensors int8 checkpoints (tiny_int8_models.py: per-channel int8,
int-quantized and pack-quantized): Qwen3-MoE, Qwen2-MoE, GLM-4.5 and Mixtral with every projection,
each expert's included, stored in int8, the routers left float, as llm-compressor's MoE recipes leave
them. Every expert's piece, at tp=1 and on both ranks of tp=2, computes with the file's integers and
scales (whatever `quantize` says); the logits are near the dequantized float model's; tp=2 == tp=1
and batched == solo."""

from __future__ import annotations

import functools

import pytest
import torch
from multiproc import RankPool
from test_moe_int4_checkpoint import WIDTHS, check_every_experts_piece_serves
from test_tp_exact import check_tp2_equals_tp1_and_batched_equals_solo, run_streams
from tiny_compressed_models import MOE_ROUTERS, moe_quantizable
from tiny_hf_models import write_hf_model
from tiny_int8_models import dequantized, float_twin, write_int8_checkpoint

from tpserve.kernels.int8_linear import Int8Weight, int8_available, reduce_range

pytestmark = pytest.mark.skipif(int8_available() is not None, reason=str(int8_available()))

# name -> (family, format)
CASES = {
    "qwen3-moe-int": ("qwen3-moe", "int-quantized"),
    "qwen2-moe-packed": ("qwen2-moe", "pack-quantized"),
    "glm4-moe-int": ("glm4-moe", "int-quantized"),
    "mixtral-packed": ("mixtral", "pack-quantized"),
}


@functools.cache
def _written(root, name: str):
    family, fmt = CASES[name]
    float_dir = write_hf_model(root / f"{name}-float", family, **WIDTHS[family])
    ignore = ("lm_head", *MOE_ROUTERS)
    return write_int8_checkpoint(float_dir, root / name, fmt, ignore=ignore, quantizable=moe_quantizable)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """name -> the case's checkpoint, written once for the module."""
    return functools.partial(_written, tmp_path_factory.mktemp("moe-int8"))


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_experts_piece_computes_with_the_files_int8_values_and_scales(moe_model, name, quantize):
    model_dir = moe_model(name)
    check_every_experts_piece_serves(model_dir, dequantized(model_dir), quantize, Int8Weight)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_logits_are_near_the_dequantized_float_model(moe_model, tmp_path, name):
    model_dir = moe_model(name)
    twin = float_twin(model_dir, tmp_path / "dequantized")
    torch.set_num_threads(1)
    float_logits, _ = run_streams(str(twin), 0, 1)
    int8_logits, _ = run_streams(str(model_dir), 0, 1)
    ours, truth = int8_logits[0], float_logits[0]  # every prompt's logits: [prompts, vocab]
    # the inputs' rounding to 8 bits per row (7 where FBGEMM's product lacks AVX-512 VNNI), each
    # product's only error, as for the dense int8 checkpoints; a route may flip on a near tie
    error = (ours - truth).norm() / truth.norm()
    bound = 0.15 if reduce_range() else 0.05
    assert 0 < error < bound, f"int8 logits {error:.4f} away from the dequantized float model (relative)"
    assert (ours.argmax(-1) == truth.argmax(-1)).sum() >= len(truth) - 1


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("name", ["qwen3-moe-int", "mixtral-packed"])
def test_tp2_equals_tp1_and_batched_equals_solo(pool, moe_model, name):
    check_tp2_equals_tp1_and_batched_equals_solo(pool, str(moe_model(name)), "none")

"""Mixtures of experts in Hugging Face int4 checkpoints: Qwen3-MoE, Qwen2-MoE, GLM-4.5 and Mixtral
with every projection, each expert's included, packed by GPTQ (v1, v2), AWQ (GEMM) or compressed-tensors
(pack-quantized) as those libraries pack them (tiny_gptq_models.py, tiny_compressed_models.py), under
the names real checkpoints use (`mlp.experts.N.gate_proj.qweight`,
`block_sparse_moe.experts.N.w1.weight_packed`), the router left float. Served in int4 as the file's
own 4-bit blocks, every expert's piece at tp=1 and on both ranks of tp=2 the library's dequantization
bit for bit; in none the dequantized float model exactly; in int4 near it; tp=2 == tp=1 and batched
== solo; a quantized router refused by name."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("compressed_tensors", minversion="0.20")  # the test extra's, on Python >= 3.11

import torch
from daemon import read_reply, running_daemon
from multiproc import RankPool
from safetensors.torch import load_file
from test_int8_checkpoint import load
from test_tp_exact import NUM_STEPS, PROMPTS, check_tp2_equals_tp1_and_batched_equals_solo, run_streams
from tiny_compressed_models import (
    decompressed,
    moe_quantizable,
    weight_args,
    write_compressed_moe_checkpoint,
)
from tiny_gptq_models import dequantized, pack_checkpoint
from tiny_hf_models import write_hf_model
from tiny_int8_models import float_twin, quantize_per_channel, write_int8_checkpoint

from tpserve.kernels.q4_linear import Q4Weight, q4_available
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import ModelFileError
from tpserve.v1 import serving_pb2

pytestmark = pytest.mark.skipif(q4_available() is not None, reason=str(q4_available()))

# Widths whose every piece is whole blocks of 32 at tp=2 (experts 64: 32 + 32 a piece; Qwen3-MoE's
# and GLM-4.5's dense layers 128, Qwen2-MoE's shared expert 64, GLM's two 128), so every product is served as the file's blocks.
WIDTHS = {
    "qwen3-moe": {"moe_intermediate_size": 64, "intermediate_size": 128},
    "qwen2-moe": {
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "intermediate_size": 128,
    },
    "glm4-moe": {"moe_intermediate_size": 64, "intermediate_size": 128},
    "mixtral": {"intermediate_size": 64},
}
# name -> (family, method, symmetric)
CASES = {
    "qwen3-moe-gptq": ("qwen3-moe", "gptq", True),
    "qwen3-moe-awq": ("qwen3-moe", "awq", False),
    "qwen3-moe-compressed": ("qwen3-moe", "compressed", False),
    "qwen3-moe-gptq-v2": ("qwen3-moe", "gptq_v2", False),  # GPTQModel's: zero points as they are
    "qwen2-moe-gptq": ("qwen2-moe", "gptq", False),
    "glm4-moe-compressed": ("glm4-moe", "compressed", False),
    "mixtral-gptq": ("mixtral", "gptq", False),
    "mixtral-awq": ("mixtral", "awq", False),
    "mixtral-compressed": ("mixtral", "compressed", True),
}


def write_moe_checkpoint(out, family: str, method: str, symmetric: bool, router: bool = False):
    """The tiny `family` with its projections (and the router, where `router`) quantized by `method`."""
    if method == "compressed":
        args = weight_args(symmetric=symmetric)
        return write_compressed_moe_checkpoint(out, family, args=args, router=router, **WIDTHS[family])
    write_hf_model(out, family, **WIDTHS[family])
    quantizable = functools.partial(moe_quantizable, router=router)
    return pack_checkpoint(out, method=method, group_size=32, sym=symmetric, quantizable=quantizable)


def library_weights(model_dir, method: str) -> dict[str, torch.Tensor]:
    """Every weight as its library dequantizes it (float32), the rest as stored."""
    return decompressed(model_dir) if method == "compressed" else dequantized(model_dir)


@functools.cache
def _written(root, name: str):
    family, method, symmetric = CASES[name]
    return write_moe_checkpoint(root / name, family, method, symmetric)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """name -> the case's checkpoint, written once for the module."""
    return functools.partial(_written, tmp_path_factory.mktemp("moe-int4"))


def served_experts(model, file):
    """(served product, the file's weights of its piece) for every expert's fused gate/up and down,
    and the shared expert's, of every sparse layer of every piece of `model`."""
    moe = model.config.moe
    for index, layer in enumerate(model.layers):
        if not moe.is_sparse(index):
            continue
        for piece, experts in zip(model.pieces, layer.mlp.pieces):
            start, end = piece.expert_intermediate
            for expert in range(moe.num_experts):
                gate, up, down = moe.expert_names(index, expert)
                yield experts.gate_ups[expert], torch.cat([file[gate][start:end], file[up][start:end]])
                yield experts.downs[expert], file[down][:, start:end]
            if experts.shared_gate_up is not None:
                gate, up, down = moe.shared_names(index)
                start, end = piece.shared_intermediate
                yield experts.shared_gate_up, torch.cat([file[gate][start:end], file[up][start:end]])
                yield experts.shared_down, file[down][:, start:end]


def check_every_experts_piece_serves(model_dir, file, quantize: str, served_type) -> None:
    """At tp=1 and on both ranks of tp=2, every expert's piece (and the shared expert's) is a
    `served_type` holding the file's values (`file`, dequantized) exactly."""
    for tp_rank, tp_size in ((0, 1), (0, 2), (1, 2)):
        model = load(model_dir, tp_rank, tp_size, quantize=quantize)
        num_served = 0
        for served, stored in served_experts(model, file):
            assert isinstance(served, served_type)
            assert torch.equal(served if isinstance(served, torch.Tensor) else served.dequantize(), stored)
            num_served += 1
        assert num_served >= model.config.moe.num_experts * 2


@pytest.mark.parametrize("quantize", ["int4", "none"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_experts_piece_serves_the_values_its_library_dequantizes(moe_model, name, quantize):
    # int4: the file's own blocks (not dequantized to float and quantized again), which dequantized
    # are the library's float32 values bit for bit; none: those values in float32.
    model_dir = moe_model(name)
    served_type = Q4Weight if quantize == "int4" else torch.Tensor
    check_every_experts_piece_serves(
        model_dir, library_weights(model_dir, CASES[name][1]), quantize, served_type
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_logits_are_near_the_dequantized_float_model(moe_model, tmp_path, name):
    model_dir = moe_model(name)
    twin = float_twin(model_dir, tmp_path / "dequantized", library_weights(model_dir, CASES[name][1]))
    torch.set_num_threads(1)
    float_logits, _ = run_streams(str(twin), 0, 1)
    int4_logits, _ = run_streams(str(model_dir), 0, 1, quantize="int4")
    plain_logits, _ = run_streams(str(model_dir), 0, 1)
    assert torch.equal(plain_logits, float_logits)  # quantize none: the very same float32 model
    ours, truth = int4_logits[0], float_logits[0]  # every prompt's logits: [prompts, vocab]
    # the inputs' rounding (8 bits per block of 32) and the head's, quantized at load to 8-bit blocks
    # (the dense int4 checkpoints' bound); a route may flip where two experts' logits nearly tie
    error = (ours - truth).norm() / truth.norm()
    assert 0 < error < 0.08, f"int4 logits {error:.4f} away from the dequantized float model (relative)"
    # int4's token is the float model's best, or one the float model scores within int4's own error
    # of it (a near tie: the compressed Qwen3-MoE's first prompt leads by 0.07)
    chosen = truth.gather(-1, ours.argmax(-1, keepdim=True)).squeeze(-1)
    assert (truth.amax(-1) - chosen <= (ours - truth).abs().amax(-1)).all()
    assert (ours.argmax(-1) == truth.argmax(-1)).sum() >= len(truth) - 1


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_equals_tp1_and_batched_equals_solo(pool, moe_model, name):
    check_tp2_equals_tp1_and_batched_equals_solo(pool, str(moe_model(name)), "int4")


@pytest.mark.parametrize("name", ["qwen3-moe-compressed", "mixtral-gptq"])
def test_the_two_rank_daemon_serves_it_in_int4_with_the_tokens_one_rank_computes(moe_model, tmp_path, name):
    model_dir = moe_model(name)
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
        assert "its int4 layers served as stored" in daemon.logs()
    for lane, reply in enumerate(replies):
        assert reply.ok and reply.token_ids == [step[lane] for step in solo_tokens], f"prompt {lane}"


# ---- refused by name ----


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("method", ["gptq", "awq", "compressed"])
def test_a_quantized_router_is_refused_by_name_at_load(tmp_path, family, method):
    model_dir = write_moe_checkpoint(tmp_path / "m", family, method, symmetric=True, router=True)
    router = "mlp.gate" if family == "qwen3-moe" else "block_sparse_moe.gate"
    with pytest.raises(ModelFileError, match=rf"model\.layers\.0\.{router} is stored quantized"):
        load(model_dir, quantize="int4")


def test_an_int8_router_is_refused_by_name_at_load(tmp_path):
    # a compressed-tensors int8 checkpoint (tiny_int8_models.py) whose router is int8 beside a scale
    float_dir = write_hf_model(tmp_path / "float", "qwen3-moe")
    router = "model.layers.0.mlp.gate"
    values, scale = quantize_per_channel(load_file(float_dir / "model.safetensors")[router + ".weight"])
    tensors = {router + ".weight": values, router + ".weight_scale": scale}
    model_dir = write_int8_checkpoint(float_dir, tmp_path / "int8", tensors=tensors)
    with pytest.raises(ModelFileError, match=rf"tensor {router}\.weight: {router} is stored quantized"):
        load(model_dir)

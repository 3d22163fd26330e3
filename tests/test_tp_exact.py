"""Two ranks give exactly what one gives: every architecture variant, logits and tokens.

tp=2 runs in two real processes, its forward collectives over gloo or over shared memory; tp=1
runs here. Thanks to the piece layout
(tpserve/ranks/sharding.py) and batch-invariant products the logits agree bit for bit, so the tokens do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_lanes import open_lane
from multiproc import RankPool, world_collectives
from safetensors.torch import load_file, save_file
from tiny_models import VARIANTS, write_tiny_model

from tpserve.kernels.attention_kernels import kv_dtype
from tpserve.kernels.int8_linear import reduce_range
from tpserve.kernels.q4_linear import Q4Weight
from tpserve.kernels.sampling import sample
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.kernels.token_counts import TokenCounts
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model

PROMPTS = [(5, 17, 99, 3, 42, 8, 250), tuple(range(20, 60)), (7,)]
SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11),
    SamplingParams(temperature=1.3, top_k=20, seed=5),
]
NUM_STEPS = 12


def run_streams(
    model_dir: str,
    tp_rank: int,
    tp_size: int,
    dtype: str = "float32",
    collectives=None,
    prompts=PROMPTS,
    samplings=SAMPLINGS,
    quantize: str = "none",
    adjusted: bool = False,
):
    """Prefill `prompts` in one pass, then NUM_STEPS decode rounds; logits and tokens (rank 0).
    `adjusted`: each stream keeps its TokenCounts for its sampling's logit adjustments."""
    torch.manual_seed(0)
    model = load_rank_model(
        model_dir,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=getattr(torch, dtype),
        max_positions=256,
        collectives=collectives,
        row_tile=16,
        quantize=quantize,
    )
    # the daemon's pool: float16 where the C attention kernel serves (kv_dtype auto)
    pool_dtype = kv_dtype("auto", model.attention, model.dtype)
    kv = KVPool(model.config.num_layers, 512, model.kv_heads_per_piece(), model.config.head_dim, pool_dtype)
    engine = Engine(model, kv)
    for lane in range(len(prompts)):
        open_lane(engine, lane, 100)
    logits = engine.forward([(lane, 0, prompt) for lane, prompt in enumerate(prompts)])
    counts = [TokenCounts(p, min_tokens=4, barred=(p[0],)) if adjusted else None for p in prompts]
    return decode_steps(engine, logits, [len(p) for p in prompts], samplings, tp_rank, tp_size, counts=counts)


def decode_steps(
    engine, logits, positions, samplings, tp_rank: int, tp_size: int, num_steps=NUM_STEPS, counts=None
):
    """After a prefill whose logits are `logits`, `num_steps` decode rounds of every lane (lane i at
    positions[i]); every step's logits and the sampled tokens on rank 0, None elsewhere."""
    all_logits, tokens = [], []
    for _ in range(num_steps):
        if tp_rank == 0:
            all_logits.append(logits.clone())
            streams = None if counts is None else [None if c is None else (c, ()) for c in counts]
            step = sample(logits, samplings, positions, streams=streams)
            tokens.append(step)
            for stream_counts, token in zip(counts or (), step):
                if stream_counts is not None:
                    stream_counts.add(token)
        else:
            step = [0] * len(positions)
        # Followers learn the sampled tokens the way the wire would tell them.
        shared = torch.tensor(step, dtype=torch.int64)
        if tp_size > 1:
            dist.broadcast(shared, src=0)
        logits = engine.forward(
            [(lane, positions[lane], (int(t),)) for lane, t in enumerate(shared.tolist())]
        )
        positions = [p + 1 for p in positions]
    return (torch.stack(all_logits), tokens) if tp_rank == 0 else None


def _tp2(ctx, model_dir, dtype, choice, quantize="none"):
    torch.set_num_threads(1)
    return run_streams(model_dir, ctx.rank, 2, dtype, world_collectives(ctx, choice), quantize=quantize)


def check_tp2_equals_tp1_and_batched_equals_solo(
    pool, model_dir: str, quantize: str, dtype: str = "float32"
) -> None:
    """The model's streams at tp=2 (on `pool`) have tp=1's tokens and logits bit for bit, and each
    stream of the batch the logits of its solo run."""
    torch.set_num_threads(1)
    solo_logits, solo_tokens = run_streams(model_dir, 0, 1, dtype, quantize=quantize)
    pair_logits, pair_tokens = pool.run(_tp2, model_dir, dtype, "gloo", quantize, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    assert torch.equal(pair_logits, solo_logits)
    for lane, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        alone, _ = run_streams(
            model_dir, 0, 1, dtype, prompts=[prompt], samplings=[sampling], quantize=quantize
        )
        assert torch.equal(solo_logits[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


def check_int4_logits_near_the_float_twin(model_dir: str, twin: str) -> None:
    """A 4-bit checkpoint's prompt logits in int4 are near those of its dequantized float `twin`
    (same argmax), and in none they are the twin's bit for bit."""
    torch.set_num_threads(1)
    one = {"prompts": PROMPTS[:1], "samplings": SAMPLINGS[:1]}
    float_logits, _ = run_streams(twin, 0, 1, **one)
    int4_logits, _ = run_streams(model_dir, 0, 1, quantize="int4", **one)
    plain_logits, _ = run_streams(model_dir, 0, 1, **one)
    first_int4, first_float = int4_logits[0], float_logits[0]  # the prompt's logits
    error = (first_int4 - first_float).norm() / first_float.norm()
    # Only the inputs' rounding (8 bits per block of 32) and the float head's, quantized at load to
    # 8-bit blocks, stand between them (test_quantized_logits_are_near_the_float_ones_but_not_the_same's
    # bound for int4).
    assert 0 < error < 0.08, f"int4 logits {error:.4f} away from the dequantized float model (relative)"
    assert torch.equal(first_int4.argmax(-1), first_float.argmax(-1))
    assert torch.equal(plain_logits, float_logits)  # quantize none: the very same float32 model


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("choice", ["gloo", "shared_memory"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_equals_tp1(pool, tmp_path, variant, choice):
    model_dir = str(write_tiny_model(tmp_path / variant, variant))
    torch.set_num_threads(1)
    solo_logits, solo_tokens = run_streams(model_dir, 0, 1)
    pair_logits, pair_tokens = pool.run(_tp2, model_dir, "float32", choice, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)
    # The sampled streams really sampled: they left the greedy path somewhere.
    greedy = [step[0] for step in solo_tokens]
    assert [step[1] for step in solo_tokens] != greedy or [step[2] for step in solo_tokens] != greedy


ADJUSTED_SAMPLINGS = [
    SamplingParams(repetition_penalty=1.3, logit_bias=((7, 2.5),)),
    SamplingParams(temperature=0.9, seed=11, presence_penalty=0.8, frequency_penalty=0.6),
    SamplingParams(temperature=1.3, top_k=20, seed=5, repetition_penalty=0.7, frequency_penalty=-0.5),
]


def _tp2_adjusted(ctx, model_dir):
    torch.set_num_threads(1)
    collectives = world_collectives(ctx, "gloo")
    return run_streams(
        model_dir, ctx.rank, 2, collectives=collectives, samplings=ADJUSTED_SAMPLINGS, adjusted=True
    )


def test_tp2_equals_tp1_and_batched_equals_solo_with_penalties_bias_and_min_tokens(pool, tmp_path):
    """The logit adjustments (tpserve/kernels/logit_adjust.py) keep both promises: tp=2's tokens are tp=1's,
    and each stream of the batch draws its solo run's tokens."""
    model_dir = str(write_tiny_model(tmp_path / "llama", "llama"))
    torch.set_num_threads(1)
    one = {"samplings": ADJUSTED_SAMPLINGS, "adjusted": True}
    solo_logits, solo_tokens = run_streams(model_dir, 0, 1, **one)
    pair_logits, pair_tokens = pool.run(_tp2_adjusted, model_dir, timeout_s=120)[0]
    assert pair_tokens == solo_tokens and torch.equal(pair_logits, solo_logits)
    plain = run_streams(model_dir, 0, 1, samplings=ADJUSTED_SAMPLINGS)[1]
    assert plain != solo_tokens, "the adjustments changed nothing"
    for lane, (prompt, sampling) in enumerate(zip(PROMPTS, ADJUSTED_SAMPLINGS)):
        _, alone = run_streams(model_dir, 0, 1, prompts=[prompt], samplings=[sampling], adjusted=True)
        assert [step[lane] for step in solo_tokens] == [step[0] for step in alone]
        # min_tokens 4 bars the prompt's first token from the first 4 draws.
        assert prompt[0] not in [step[lane] for step in solo_tokens[:4]]


@pytest.mark.parametrize("choice", ["gloo", "shared_memory"])
def test_tp2_equals_tp1_bfloat16(pool, tmp_path, choice):
    model_dir = str(write_tiny_model(tmp_path / "llama", "llama"))
    torch.set_num_threads(1)
    solo_logits, solo_tokens = run_streams(model_dir, 0, 1, "bfloat16")
    pair_logits, pair_tokens = pool.run(_tp2, model_dir, "bfloat16", choice, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_stream_of_a_batch_has_the_logits_of_its_solo_run(tmp_path, variant, dtype):
    # Batch invariance on the logits themselves, bit for bit: the three streams prefilled in one
    # pass and decoded in shared rounds against each one alone.
    model_dir = str(write_tiny_model(tmp_path / variant, variant))
    torch.set_num_threads(1)
    together, _ = run_streams(model_dir, 0, 1, dtype)
    for lane, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        alone, _ = run_streams(model_dir, 0, 1, dtype, prompts=[prompt], samplings=[sampling])
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


# ---- quantized weights (tpserve/kernels/weight_formats.py) ----

QUANTIZED = ["int8", "int4"]


@pytest.mark.parametrize("quantize", QUANTIZED)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_tp2_equals_tp1(pool, tmp_path, variant, quantize):
    model_dir = str(write_tiny_model(tmp_path / variant, variant))
    torch.set_num_threads(1)
    solo_logits, solo_tokens = run_streams(model_dir, 0, 1, quantize=quantize)
    pair_logits, pair_tokens = pool.run(_tp2, model_dir, "float32", "gloo", quantize, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    assert torch.equal(pair_logits, solo_logits)


@pytest.mark.parametrize("quantize", QUANTIZED)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_streams_of_a_batch_have_the_logits_of_their_solo_runs(tmp_path, variant, quantize):
    model_dir = str(write_tiny_model(tmp_path / variant, variant))
    torch.set_num_threads(1)
    together, _ = run_streams(model_dir, 0, 1, quantize=quantize)
    for lane, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        alone, _ = run_streams(model_dir, 0, 1, prompts=[prompt], samplings=[sampling], quantize=quantize)
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


def on_the_4_bit_grid(model_dir: str) -> str:
    """The tiny model with every linear weight rounded to 4-bit blocks, as a dequantized Q4_1 GGUF's
    are: int4 then differs from float32 only by its 8-bit inputs (and the head's int8)."""
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    for name, weight in tensors.items():
        if name.endswith("_proj.weight"):
            tensors[name] = Q4Weight(weight).dequantize()
    save_file(tensors, path)
    return model_dir


# int8's inputs go in 7 bits where FBGEMM's product lacks AVX-512 VNNI (tpserve/kernels/int8_linear.py's
# reduce_range: 8 bits would saturate its int16 sums there): twice the rounding step.
INT8_BOUND = 0.15 if reduce_range() else 0.05


@pytest.mark.parametrize(("quantize", "bound"), [("int8", INT8_BOUND), ("int4", 0.08)])
def test_quantized_logits_are_near_the_float_ones_but_not_the_same(tmp_path, quantize, bound):
    model_dir = on_the_4_bit_grid(str(write_tiny_model(tmp_path / "llama", "llama")))
    torch.set_num_threads(1)
    float_logits, _ = run_streams(model_dir, 0, 1, prompts=PROMPTS[:1], samplings=SAMPLINGS[:1])
    quantized, _ = run_streams(
        model_dir, 0, 1, prompts=PROMPTS[:1], samplings=SAMPLINGS[:1], quantize=quantize
    )
    first_float, first = float_logits[0], quantized[0]  # the prompt's logits, before the paths part
    error = (first - first_float).norm() / first_float.norm()
    assert 0 < error < bound, f"{quantize} logits {error:.4f} away from float32 (relative)"

"""The sampler: greedy ties, position-keyed draws, the filters, dtypes, and top_logits."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from tpserve.kernels.sampling import _gumbel, _row_key, sample, top_logits
from tpserve.kernels.sampling_params import SamplingParams


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _draw_many(logits_row: list[float], params: SamplingParams, num_draws: int) -> np.ndarray:
    """Counts per token of num_draws draws from one row, at positions 0..num_draws-1."""
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(num_draws, -1)
    tokens = sample(logits, [params] * num_draws, list(range(num_draws)))
    return np.bincount(tokens, minlength=len(logits_row))


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _softmax(logits: list[float], temperature: float) -> np.ndarray:
    scaled = np.array(logits, dtype=np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def test_greedy_tie_goes_to_lower_id():
    logits = _rows([0.0, 5.0, 1.0, 5.0, 5.0], [9.0, 1.0, 9.0, 9.0, 2.0], [-1.0, -1.0, -1.0, -1.0, -1.0])
    assert sample(logits, [SamplingParams()] * 3, [0, 1, 2]) == [1, 0, 0]


def test_top_k_one_tie_goes_to_lower_id():
    logits = _rows([0.0, 3.0, 0.0, 3.0])
    params = [SamplingParams(temperature=1.0, top_k=1, seed=seed) for seed in range(20)]
    assert sample(logits.expand(20, -1), params, list(range(20))) == [1] * 20


def test_equal_perturbed_values_go_to_the_lower_id():
    # The noise has 23 bits, so among equal logits two tokens sometimes share the highest noise.
    vocab = np.arange(8192)
    tied = None
    for position in range(20000):
        noise = _gumbel(np.uint64(_row_key(0, position)), vocab)
        winners = np.flatnonzero(noise == noise.max())
        if len(winners) > 1:
            tied = (position, int(winners[0]))
            break
    assert tied is not None, "no position in 20000 gave two tokens the same highest noise"
    position, lower = tied
    assert sample(torch.zeros(1, 8192), [SamplingParams(temperature=1.0, seed=0)], [position]) == [lower]


def test_draw_depends_only_on_row_seed_position_and_params():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 3000, generator=generator) * 2
    params = [
        SamplingParams(temperature=0.5 + 0.1 * i, top_k=(0, 5, 50)[i % 3], top_p=(1.0, 0.9)[i % 2], seed=i)
        for i in range(12)
    ]
    params[4] = SamplingParams()  # a greedy row among them
    positions = [7 * i + 3 for i in range(12)]
    solo = [sample(logits[i : i + 1], [params[i]], [positions[i]])[0] for i in range(12)]

    # The same rows in another order, with unrelated rows between them.
    order = torch.randperm(12, generator=generator).tolist()
    filler = torch.randn(12, 3000, generator=generator)
    batch = torch.cat([torch.stack([logits[i], filler[i]]) for i in order])
    batch_params = [q for i in order for q in (params[i], SamplingParams(temperature=1.0, seed=99))]
    batch_positions = [q for i in order for q in (positions[i], 5)]
    mixed = sample(batch, batch_params, batch_positions)
    assert [mixed[2 * order.index(i)] for i in range(12)] == solo


def test_different_seeds_draw_differently():
    params_a = SamplingParams(temperature=1.0, seed=1)
    params_b = SamplingParams(temperature=1.0, seed=2)
    flat = torch.zeros(300, 1000)
    draws_a = sample(flat, [params_a] * 300, list(range(300)))
    draws_b = sample(flat, [params_b] * 300, list(range(300)))
    assert sum(a == b for a, b in zip(draws_a, draws_b)) < 15  # about 0.3 expected
    assert len(set(draws_a)) > 200  # positions draw differently too (about 259 expected)
    assert draws_a == sample(flat, [params_a] * 300, list(range(300)))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_softmax_of_scaled_logits(temperature):
    logits = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
    counts = _draw_many(logits, SamplingParams(temperature=temperature, seed=11), 6000)
    # 5 degrees of freedom: chi-square above 30 has probability about 1e-5.
    assert _chi_square(counts, _softmax(logits, temperature)) < 30


def test_lower_temperature_sharpens():
    logits = [1.0, 0.5, 0.0, -0.5]
    top_shares = [
        _draw_many(logits, SamplingParams(temperature=t, seed=5), 3000)[0] / 3000 for t in (2.0, 1.0, 0.3)
    ]
    assert top_shares[0] < top_shares[1] < top_shares[2]
    assert top_shares[2] > 0.8


def test_top_k_one_equals_greedy():
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=3.0, top_k=1, seed=s) for s in range(64)]
    assert sample(logits, params, list(range(64))) == sample(logits, [SamplingParams()] * 64, [0] * 64)


def test_top_k_keeps_only_the_k_best():
    logits = [0.0, 3.0, 1.0, 2.9, 2.8, 0.5]
    counts = _draw_many(logits, SamplingParams(temperature=1.0, top_k=3, seed=3), 3000)
    assert set(np.flatnonzero(counts)) == {1, 3, 4}
    kept = [logits[i] for i in (1, 3, 4)]
    assert _chi_square(counts[[1, 3, 4]], _softmax(kept, 1.0)) < 25


def test_tiny_top_p_equals_greedy():
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=3.0, top_p=1e-6, seed=s) for s in range(64)]
    assert sample(logits, params, list(range(64))) == sample(logits, [SamplingParams()] * 64, [0] * 64)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = np.log([0.1, 0.4, 0.2, 0.3]).tolist()
    # 0.4 alone is short of 0.5; with 0.3 the mass reaches it, so tokens 1 and 3 stay.
    counts = _draw_many(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=8), 4000)
    assert set(np.flatnonzero(counts)) == {1, 3}
    assert _chi_square(counts[[1, 3]], np.array([4 / 7, 3 / 7])) < 20


def test_top_p_measures_mass_after_top_k():
    logits = np.log([0.3, 0.25, 0.2, 0.15, 0.1]).tolist()
    # Over the whole row token 0 has 0.3 < 0.5, so top_p alone keeps tokens 0 and 1; after top_k=2
    # renormalises, token 0 has 0.545 and is enough alone.
    alone = _draw_many(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=4), 400)
    assert set(np.flatnonzero(alone)) == {0, 1}
    after_top_k = _draw_many(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=4), 400)
    assert set(np.flatnonzero(after_top_k)) == {0}


def test_min_p_drops_tokens_below_its_share_of_the_max():
    logits = np.log([0.05, 0.5, 0.3, 0.15]).tolist()
    # min_p 0.2 of max 0.5 is 0.1: only token 0 (0.05) goes.
    counts = _draw_many(logits, SamplingParams(temperature=1.0, min_p=0.2, seed=6), 4000)
    assert set(np.flatnonzero(counts)) == {1, 2, 3}
    assert _chi_square(counts[1:], np.array([0.5, 0.3, 0.15]) / 0.95) < 25
    # min_p 0.7 of 0.5 is 0.35: only the max is left.
    only_max = _draw_many(logits, SamplingParams(temperature=1.0, min_p=0.7, seed=6), 300)
    assert set(np.flatnonzero(only_max)) == {1}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_draw_as_their_float32_values(dtype):
    logits = (torch.randn(16, 4000, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=s) if s % 4 else SamplingParams() for s in range(16)
    ]
    positions = list(range(100, 116))
    assert sample(logits, params, positions) == sample(logits.float(), params, positions)
    tied = torch.tensor([[1.0, 4.0, 4.0, 0.0]], dtype=dtype)
    assert sample(tied, [SamplingParams()], [0]) == [1]


def test_rows_without_a_distribution_keep_their_greedy_token():
    inf = math.inf
    logits = _rows(
        [-inf, -inf, -inf],  # nothing finite
        [math.nan, 1.0, 2.0],  # a NaN never wins
        [0.0, 1e30, 2.0],  # overflows to +inf at a tiny temperature
        [0.5, 0.1, 0.3],  # min_p above 1 would leave nothing
    )
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1e-30, seed=1),
        SamplingParams(temperature=1.0, min_p=1.5, seed=1),
    ]
    assert sample(logits, params, [0, 1, 2, 3]) == [0, 2, 1, 0]
    nan_draws = _draw_many([math.nan, 1.0, 1.0, math.nan], SamplingParams(temperature=1.0, seed=2), 200)
    assert nan_draws[0] == nan_draws[3] == 0


def _reference_draw(row: torch.Tensor, p: SamplingParams, position: int) -> int:
    """The rules written plainly over the whole vocabulary, with a full sort, in float64 masses."""
    scaled = row.numpy() / np.float32(p.temperature)
    order = np.argsort(-scaled, kind="stable")  # highest first, equal values by lower id
    keep = np.ones(len(scaled), dtype=bool)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    if p.top_p < 1.0:
        weights = np.where(keep, np.exp(scaled - scaled.max()), 0.0).astype(np.float64)[order]
        mass_before = np.cumsum(weights / weights.sum()) - weights / weights.sum()
        keep[order[1:][mass_before[1:] >= p.top_p]] = False
    if p.min_p > 0.0:
        keep &= np.exp(scaled.astype(np.float64) - scaled.max()) >= p.min_p
    ids = np.flatnonzero(keep)
    perturbed = scaled[ids] + _gumbel(np.uint64(_row_key(p.seed, position)), ids)
    return int(ids[perturbed == perturbed.max()].min())


def test_matches_a_plain_full_vocabulary_reference():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(40, 2000, generator=generator) * torch.linspace(1, 6, 40).unsqueeze(-1)
    params = [
        SamplingParams(
            temperature=(0.3, 0.7, 1.0, 1.6)[i % 4],
            top_k=(0, 1, 20, 500, 5000)[i % 5],
            top_p=(1.0, 0.3, 0.9)[i % 3],
            min_p=(0.0, 0.05)[i % 7 == 1],
            seed=1000 + i,
        )
        for i in range(40)
    ]
    positions = [17 * i for i in range(40)]
    expected = [_reference_draw(logits[i], params[i], positions[i]) for i in range(40)]
    assert sample(logits, params, positions) == expected


def test_sixteen_rows_of_a_real_vocabulary_are_fast():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 49152, generator=generator) * 2.5
    logits[:, :20] += torch.linspace(18, 8, 20)  # a peaked head over a broad tail, like a model's
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40 * (i % 2), seed=i) for i in range(16)]
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        sample(logits, params, list(range(16)))
        timings.append(time.perf_counter() - start)
    assert min(timings) < 0.02  # a few ms here; the bound leaves room for a loaded machine


def test_top_logits_lists_the_highest_first_ties_to_lower_id():
    logits = _rows([0.5, 2.0, 1.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0, 3.0]).to(torch.bfloat16)
    assert top_logits(logits, 3) == [[(1, 2.0), (3, 2.0), (2, 1.0)], [(0, 3.0), (1, 3.0), (2, 3.0)]]
    assert top_logits(logits, 9)[0] == [(1, 2.0), (3, 2.0), (2, 1.0), (0, 0.5), (4, -1.0)]
    assert top_logits(logits, 0) == [[], []]

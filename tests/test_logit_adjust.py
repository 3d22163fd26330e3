"""Rank 0's logit adjustments (tpserve/kernels/logit_adjust.py) against a plain per-token reference, and the
draw that follows them: a row is adjusted the same alone or among other rows."""

from __future__ import annotations

import numpy as np
import torch

from tpserve.kernels.logit_adjust import adjust_logits
from tpserve.kernels.sampling import sample
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.kernels.token_counts import TokenCounts

VOCAB = 50


def counts_of(prompt, reply, **kwargs) -> TokenCounts:
    counts = TokenCounts(prompt, **kwargs)
    for token in reply:
        counts.add(token)
    return counts


def reference(row: np.ndarray, p: SamplingParams, counts: TokenCounts, fed=()) -> np.ndarray:
    """vLLM's order, one token at a time: bias, barred ids, repetition, frequency and presence."""
    row = row.copy()
    for token, bias in p.logit_bias:
        row[token] += np.float32(bias)
    reply = dict(zip(counts.reply_ids, counts.reply_times))
    for token in fed:
        reply[token] = reply.get(token, 0) + 1
    if counts.num_output + len(fed) < counts.min_tokens:
        row[list(counts.barred)] = -np.inf
    if p.repetition_penalty != 1.0:
        penalty = np.float32(p.repetition_penalty)
        for token in set(counts.prompt_ids) | set(reply):
            row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token, times in reply.items():
        row[token] -= np.float32(p.frequency_penalty) * np.float32(times) + np.float32(p.presence_penalty)
    return row


CASES = [
    (SamplingParams(repetition_penalty=1.5), counts_of([1, 2, 2, 3], [4, 4, 5]), ()),
    (SamplingParams(frequency_penalty=0.7, presence_penalty=0.3), counts_of([9], [4, 4, 4, 6]), (4, 7)),
    (SamplingParams(logit_bias=((3, 5.0), (8, -100.0))), counts_of([1], [], min_tokens=2, barred=(0, 5)), ()),
    (SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0), counts_of([3, 3], [2]), (3,)),
]


def test_each_row_is_adjusted_as_the_plain_reference_says_alone_or_batched():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(len(CASES) + 1, VOCAB)).astype(np.float32)
    batched = scores.copy()
    params = [p for p, _, _ in CASES] + [SamplingParams()]
    adjust_logits(batched, params, [(c, fed) for _, c, fed in CASES] + [None])
    for i, (p, counts, fed) in enumerate(CASES):
        alone = scores[i : i + 1].copy()
        adjust_logits(alone, [p], [(counts, fed)])
        assert np.array_equal(alone[0], batched[i])
        assert np.array_equal(batched[i], reference(scores[i], p, counts, fed))
    assert np.array_equal(batched[-1], scores[-1]), "a row with no stream tokens is left alone"


def test_the_draw_reads_the_adjusted_logits_but_the_callers_stay_raw():
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 1.0  # greedy picks 9 ...
    raw = logits.clone()
    biased = SamplingParams(logit_bias=((20, 3.0),))
    short = counts_of([1], [], min_tokens=1, barred=(9,))
    tokens = sample(
        logits, [biased, SamplingParams()], [0, 0], streams=[(counts_of([1], []), ()), (short, ())]
    )
    assert tokens == [20, 0]  # ... unless a bias lifts 20 above it, or min_tokens bars it (ties: lowest id)
    assert torch.equal(logits, raw)

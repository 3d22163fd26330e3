"""The grammar mask in the sampler: a masked row draws only allowed tokens, and a row's draw is the
same whatever rows (masked or not) share its pass."""

from __future__ import annotations

import numpy as np
import torch

from tpserve.kernels.sampling import sample
from tpserve.kernels.sampling_params import SamplingParams

VOCAB = 300


def bitmask(allowed: list[int]) -> np.ndarray:
    words = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    for token in allowed:
        words[token // 32] |= np.int32(1 << (token % 32)) if token % 32 < 31 else np.int32(-(2**31))
    return words


def test_a_masked_row_draws_only_allowed_tokens_alone_or_batched():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    allowed = [3, 31, 63, 299]
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5)] * 2
    masks = [bitmask(allowed), bitmask(allowed), None, None]
    batched = sample(logits, params, [10, 10, 10, 10], masks)
    assert batched[0] in allowed and batched[1] in allowed
    for row in range(4):
        alone = sample(logits[row : row + 1], params[row : row + 1], [10], masks[row : row + 1])
        assert alone == [batched[row]]
    assert batched[2:] == sample(logits[2:], params[2:], [10, 10])  # unmasked rows are untouched
    for position in range(50):  # many draws: never a refused token
        assert sample(logits[1:2], params[1:2], [position], [bitmask(allowed)])[0] in allowed


def test_tokens_past_the_mask_are_refused():
    logits = torch.zeros(1, VOCAB + 40)
    logits[0, VOCAB + 35] = 100.0  # the likeliest token lies past the mask's end
    assert sample(logits, [SamplingParams()], [0], [bitmask([7])]) == [7]

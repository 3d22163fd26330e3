"""Rank 0's log probabilities: a log-softmax of the raw logits, the sampled token's and the likeliest."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels.sampling import token_logprobs


def test_logprobs_are_the_log_softmax_with_the_likeliest_first():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 10.0], [5.0, 1.0, 1.0, 1.0]])
    found = token_logprobs(logits, [2, 3, 0], [2, 0, -1])
    reference = torch.log_softmax(logits.double(), dim=-1)
    (first_value, first_top), (second_value, second_top), third = found
    assert first_value == pytest.approx(reference[0, 2].item(), rel=1e-12)
    # Equal logits (ids 1 and 3) go to the lower id first, as every argmax here does.
    assert [t for t, _ in first_top] == [1, 3]
    assert [v for _, v in first_top] == pytest.approx([reference[0, 1].item()] * 2, rel=1e-12)
    assert second_value == pytest.approx(reference[1, 3].item()) and second_top == []
    assert third is None  # that row did not ask


def test_a_nan_logit_reads_as_impossible():
    logits = torch.tensor([[0.0, float("nan"), 0.0]])
    ((value, top),) = token_logprobs(logits, [0], [3])
    assert value == pytest.approx(-0.6931471805599453)
    assert [t for t, _ in top] == [0, 2, 1] and top[2][1] == float("-inf")

"""Greedy rows sampled where the logits are: argmax on the device, only the token ids copied back.

A pass whose every row is greedy, unmasked, unadjusted and asks no log probabilities needs nothing
of its logits but each row's argmax: on a GPU that is one reduction and a copy of [rows] int64,
instead of [rows, vocab] float32 to the host and numpy's argmax there. The ids are the host
sampler's (kernels/sampling.py): NaN reads as -inf, and ties go to the lower token id (torch's
argmax returns the first maximal index, as numpy's does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tpserve.kernels.sampling_params import SamplingParams


def greedy_on_device(
    params: Sequence[SamplingParams],
    allowed: Sequence[np.ndarray | None] | None = None,
    streams: Sequence[object | None] | None = None,
) -> bool:
    """Whether every row's token is the argmax of its raw logits, with nothing else read of them:
    greedy, no grammar mask, no logit adjustment, no log probabilities."""
    plain = all(p.greedy and p.logprobs < 0 and not p.adjusts_logits for p in params)
    masked = allowed is not None and any(mask is not None for mask in allowed)
    adjusted = streams is not None and any(row is not None for row in streams)
    return plain and not masked and not adjusted


def samples_on_device(
    device_type: str,
    params: Sequence[SamplingParams],
    allowed: Sequence[np.ndarray | None] | None = None,
    streams: Sequence[object | None] | None = None,
    records_logits: bool = False,
) -> bool:
    """Whether a decode round's tokens are taken on the device: on a GPU (where the logits' copy and
    numpy's argmax would wait in series with the next round; on the CPU they are where the host
    sampler reads them already), for a round greedy_on_device takes, whose logits nothing else
    reads (records_logits: the recorder's top logits)."""
    return device_type == "cuda" and not records_logits and greedy_on_device(params, allowed, streams)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] on any device -> [rows] int64 on that device: each row's argmax, NaN
    read as -inf, ties to the lower id."""
    scores = torch.where(logits.isnan(), float("-inf"), logits)
    return scores.argmax(dim=-1)

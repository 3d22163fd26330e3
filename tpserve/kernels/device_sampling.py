"""Rows sampled where the logits are: on the device only what a draw reads is kept, and copied back.

A pass whose every row is greedy, unmasked, unadjusted and asks no log probabilities needs nothing
of its logits but each row's argmax: on a GPU that is one reduction and a copy of [rows] int64,
instead of [rows, vocab] float32 to the host and numpy's argmax there. The ids are the host
sampler's (tpserve/kernels/sampling.py): NaN reads as -inf, and ties go to the lower token id (torch's
argmax returns the first maximal index, as numpy's does).

A sampled row (plain too) reads, in the host sampler, only the tokens whose scaled logit is within
the Gumbel noise's span of the row's max (the others can never win), and, for top_p with top_k,
the top_k best (whose mass top_p measures). `shortlist` keeps, on the device, a superset of those
(elementwise comparisons with a looser bound than the host's, and a topk whose k-th value is exact),
and copies back each row's argmax and the listed tokens' ids and float32 logits: a few dozen per
row instead of the vocabulary. The host sampler then draws over them in float32 numpy
(sampling.sample_listed), each row's token bit for bit the one `sample` draws from its whole row.
top_p without top_k needs the mass of the whole row, so such a row keeps the full copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tpserve.kernels.sampling import GUMBEL_SPAN
from tpserve.kernels.sampling_params import SamplingParams

# The device's bound sits this much below the host sampler's (tpserve/kernels/sampling.py _candidates, whose
# own margin is 0.01 + 1e-5 * |max| in scaled units): far more than the few float32 roundings by
# which the device's sums and the host's quotients can differ, so it never lists fewer tokens.
_EXTRA_SPAN = 0.02
_EXTRA_RELATIVE = 2e-5


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


def lists_on_device(
    device_type: str,
    params: Sequence[SamplingParams],
    allowed: Sequence[np.ndarray | None] | None = None,
    streams: Sequence[object | None] | None = None,
    records_logits: bool = False,
) -> bool:
    """Whether a decode round's rows are shortlisted on the device (`shortlist`): on a GPU, for a
    round samples_on_device does not take whose rows are plain (greedy_on_device's terms, but any
    temperature), and read no whole-row mass (top_p only with top_k), and whose logits nothing else
    reads."""
    if device_type != "cuda" or records_logits or samples_on_device(device_type, params, allowed, streams):
        return False
    plain = all(p.logprobs < 0 and not p.adjusts_logits for p in params)
    whole_mass = any(not p.greedy and p.top_p < 1.0 and p.top_k <= 0 for p in params)
    masked = allowed is not None and any(mask is not None for mask in allowed)
    adjusted = streams is not None and any(row is not None for row in streams)
    return plain and not whole_mass and not masked and not adjusted


@dataclass(frozen=True)
class Shortlist:
    """A round's shortlist on the host: the rows' vocab_size; greedy_ids [rows] (each row's argmax);
    rows, ids, logits [n]: the listed tokens (float32 logits, NaN read as -inf), by row, then id."""

    vocab_size: int
    greedy_ids: np.ndarray
    rows: np.ndarray
    ids: np.ndarray
    logits: np.ndarray

    @staticmethod
    def unpack(packed: torch.Tensor) -> Shortlist:
        """From `shortlist`'s one int32 tensor (on the host): [num_rows, vocab_size, greedy ids...],
        then either [0, the listed tokens per row..., their ids..., their logits' float32 bits...]
        or [1, every logit's bits, row by row] (the whole rows, when listing cost more)."""
        flat = packed.numpy()
        num_rows, vocab_size = int(flat[0]), int(flat[1])
        greedy, whole, rest = (
            flat[2 : 2 + num_rows].astype(np.int64),
            flat[2 + num_rows],
            flat[3 + num_rows :],
        )
        if whole:
            rows = np.repeat(np.arange(num_rows), vocab_size)
            return Shortlist(
                vocab_size, greedy, rows, np.tile(np.arange(vocab_size), num_rows), rest.view(np.float32)
            )
        counts, listed = rest[:num_rows], rest[num_rows:].reshape(2, -1)
        rows = np.repeat(np.arange(num_rows), counts)
        return Shortlist(vocab_size, greedy, rows, listed[0].astype(np.int64), listed[1].view(np.float32))


def shortlist(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    to_host: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.cpu,
) -> torch.Tensor:
    """logits [rows, vocab] on any device -> one int32 tensor on that device (Shortlist.unpack): each
    row's argmax and its `listed` tokens' ids and logits, at 8 bytes a token; or, where that would
    cost more than the whole rows' 4 bytes a logit, the whole rows. The list's size is the one value
    that must reach the host first; `to_host` brings it (on a GPU, tpserve/ranks/device_wait.py's to_host, so
    even that wait has a deadline), and the rest is taken at that known size, with no other sync."""
    scores = torch.where(logits.isnan(), float("-inf"), logits.float())  # [rows, vocab], exact
    num_rows, vocab_size = scores.shape
    listed = _listed(scores, params)  # [rows, vocab] bool
    counts = listed.sum(dim=-1, dtype=torch.int32)  # [rows]
    head = torch.tensor([num_rows, vocab_size], dtype=torch.int32, device=scores.device)
    greedy = greedy_ids(logits).to(torch.int32)
    total = int(to_host(counts.sum()))
    if 2 * total >= scores.numel():
        whole = torch.ones(1, dtype=torch.int32, device=scores.device)
        return torch.cat([head, greedy, whole, scores.view(torch.int32).flatten()])
    rows, ids = torch.nonzero_static(listed, size=total).unbind(dim=1)  # row-major: by row, then id
    bits = scores[rows, ids].view(torch.int32)
    return torch.cat(
        [
            head,
            greedy,
            torch.zeros(1, dtype=torch.int32, device=scores.device),
            counts,
            ids.to(torch.int32),
            bits,
        ]
    )


def _listed(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """scores [rows, vocab] float32 (no NaN) -> [rows, vocab] bool: for each sampled row, every token
    within the Gumbel span (plus _EXTRA_*) of its max, in raw logit units (the span times the
    temperature), and for a row with top_p and top_k every token at least its k-th best logit.
    Greedy rows and rows whose max is -inf list nothing."""
    device = scores.device
    best = scores.max(dim=-1, keepdim=True).values  # [rows, 1]
    temperature = torch.tensor(
        [[max(p.temperature, 0.0)] for p in params], dtype=torch.float32, device=device
    )
    floor = best - temperature * (GUMBEL_SPAN + _EXTRA_SPAN) - _EXTRA_RELATIVE * best.abs()  # [rows, 1]
    # -inf minus anything would list every token; +inf minus +inf is NaN, which lists nothing.
    listless = torch.tensor([[p.greedy] for p in params], device=device) | best.isneginf()
    listed = scores >= torch.where(listless, float("inf"), floor)  # [rows, vocab]
    top_ks = [min(p.top_k, scores.shape[-1]) if not p.greedy and p.top_p < 1.0 else 0 for p in params]
    if max(top_ks) > 0:  # the top_k best by raw logit are the top_k best by scaled logit
        k = torch.tensor(top_ks, device=device)
        kth = scores.topk(max(top_ks), dim=-1).values[torch.arange(len(params), device=device), k - 1]
        listed |= scores >= torch.where(k > 0, kth, float("inf"))[:, None]
    return listed


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] on any device -> [rows] int64 on that device: each row's argmax, NaN
    read as -inf, ties to the lower id."""
    scores = torch.where(logits.isnan(), float("-inf"), logits)
    return scores.argmax(dim=-1)

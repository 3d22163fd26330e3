"""Rank 0's sampler: turns a pass's logits into one token per row, and reads the top logits.

Every draw is position-keyed: a sampled row's noise is a hash of (seed, position, token id), and the
token is argmax(log_softmax + Gumbel(noise)) over the tokens the filters keep. So a draw depends only
on (logits row, seed, position, params), never on which row, lane or batch it ran in. Every argmax,
greedy or sampled, breaks ties toward the lower token id, and every step is written so that a row
never turns into a NaN decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tpserve.ranks.sampling_params import SamplingParams

__all__ = ["sample", "top_logits"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_UNIFORM_BITS = 23  # a float32 holds (i + 0.5) / 2**23 exactly for every i < 2**23, and never 0 or 1


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """One token per row of `logits` [num_rows, vocab_size], drawn as each row's params say.

    positions[i] is the position of the token row i draws; with params[i].seed it keys the noise.
    """
    num_rows = logits.shape[0] if logits.dim() == 2 else -1
    if num_rows < 0 or len(params) != num_rows or len(positions) != num_rows:
        raise ValueError(
            f"sample needs logits [num_rows, vocab] and one params and position per row; got logits "
            f"{tuple(logits.shape)}, {len(params)} params, {len(positions)} positions"
        )
    scores = _as_float32(logits)  # [num_rows, vocab]
    tokens = _argmax_lowest(scores)  # the greedy choice of every row, [num_rows]
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=scores.device)
        drawn = _draw(
            scores.index_select(0, rows),
            [params[row] for row in sampled],
            [positions[row] for row in sampled],
            tokens.index_select(0, rows),
        )
        tokens.index_copy_(0, rows, drawn)
    return tokens.tolist()


def top_logits(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k highest logits as (token id, value), highest first, equal values by lower id."""
    scores = _as_float32(logits).cpu()  # [num_rows, vocab]
    k = max(0, min(k, scores.shape[-1]))
    if k == 0:
        return [[] for _ in range(scores.shape[0])]
    # topk's values are exact, but its order among equal values is not promised: keep every token
    # at or above the k-th value, then order those by value with a stable sort (ids ascend already).
    kth = scores.topk(k, dim=-1).values[:, -1:]  # [num_rows, 1]
    result = []
    for row, threshold in zip(scores, kth):
        ids = torch.nonzero(row >= threshold).flatten()
        order = torch.sort(row[ids], descending=True, stable=True).indices[:k]
        result.append([(int(i), float(v)) for i, v in zip(ids[order], row[ids[order]])])
    return result


def _as_float32(logits: torch.Tensor) -> torch.Tensor:
    # A NaN logit can never win: it reads as -inf, so no comparison below ever sees a NaN.
    scores = logits.detach().to(torch.float32)
    return scores.masked_fill(torch.isnan(scores), -math.inf)


def _argmax_lowest(scores: torch.Tensor) -> torch.Tensor:
    """argmax along the last dim, ties to the lower index (torch.argmax does not promise that)."""
    vocab_size = scores.shape[-1]
    ids = torch.arange(vocab_size, device=scores.device)
    at_max = scores == scores.max(dim=-1, keepdim=True).values  # [rows, vocab]
    return torch.where(at_max, ids, vocab_size).min(dim=-1).values


def _draw(
    scores: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    greedy_tokens: torch.Tensor,
) -> torch.Tensor:
    """The sampled token of every row of scores [n, vocab] (float32, no NaN)."""
    device = scores.device
    temperatures = torch.tensor([p.temperature for p in params], device=device).unsqueeze(-1)
    scaled = scores / temperatures  # [n, vocab]
    # A row whose scaled max is not finite (all -inf, or overflowed to +inf by a tiny temperature)
    # has no distribution to draw from: it keeps its greedy token.
    row_ok = torch.isfinite(scaled.max(dim=-1).values)  # [n]
    scaled = torch.where(row_ok.unsqueeze(-1), scaled, torch.zeros((), device=device))
    logp = torch.log_softmax(scaled, dim=-1)  # [n, vocab]; -inf only where the logit was -inf

    keep = logp > -math.inf
    if any(p.top_k > 0 for p in params):
        keep &= _top_k_mask(logp, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        keep &= _top_p_mask(logp.masked_fill(~keep, -math.inf), [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        # p >= min_p * p_max, read in log space; the max token survives every filter, and renormalising
        # the kept set does not change the ratio, so the unfiltered log-probs serve.
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device)
        keep &= logp - logp.max(dim=-1, keepdim=True).values >= log_min_p.unsqueeze(-1)

    keys = [_row_key(p.seed, position) for p, position in zip(params, positions)]
    perturbed = torch.where(keep, logp + _gumbel_noise(keys, scores.shape[-1], device), -math.inf)
    drawn = _argmax_lowest(perturbed)
    return torch.where(row_ok & keep.any(dim=-1), drawn, greedy_tokens)


def _top_k_mask(logp: torch.Tensor, top_ks: Sequence[int]) -> torch.Tensor:
    """Keep each row's top_k highest tokens (0 keeps all); among equal values the lower ids go first."""
    vocab_size = logp.shape[-1]
    ks = [k if 0 < k < vocab_size else vocab_size for k in top_ks]
    ks_t = torch.tensor(ks, device=logp.device).unsqueeze(-1)  # [n, 1]
    top = logp.topk(max(ks), dim=-1).values  # [n, max_k], highest first
    kth = top.gather(-1, ks_t - 1)  # [n, 1], the k-th highest value of each row
    above = logp > kth
    # The k-th value may be shared: fill the places left after the strictly higher tokens with the
    # lowest ids holding exactly that value.
    at_kth = logp == kth
    places_left = ks_t - above.sum(dim=-1, keepdim=True)
    return above | (at_kth & (torch.cumsum(at_kth, dim=-1) <= places_left))


def _top_p_mask(logp: torch.Tensor, top_ps: Sequence[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one; 1.0 keeps all).

    logp [n, vocab] holds -inf for tokens already filtered out; the mass is over the rest, renormalised.
    """
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logp, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens strictly ahead of each
    # 1.0 means off: spelled out, since rounding can make a cumulative sum reach 1 before the tail.
    thresholds = torch.tensor([p if p < 1.0 else math.inf for p in top_ps], device=logp.device)
    keep_sorted = mass_before < thresholds.unsqueeze(-1)
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _row_key(seed: int, position: int) -> int:
    """The 64-bit key of one draw; exact Python integers, so any seed or position is well defined."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), without ever overflowing int64.

    The constant's top bit is split off: x * 2**31 mod 2**32 is just x's low bit moved to bit 31,
    and x times the remaining 31 bits stays below 2**63.
    """
    low = constant & 0x7FFFFFFF
    product = x * low
    if constant >> 31:
        product += (x & 1) << 31
    return product & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (Wellons' lowbias32), on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _gumbel_noise(keys: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Gumbel noise [len(keys), vocab] where entry (r, t) depends only on (keys[r], t)."""
    key_low = torch.tensor([k & _MASK32 for k in keys], dtype=torch.int64, device=device).unsqueeze(-1)
    key_high = torch.tensor([k >> 32 for k in keys], dtype=torch.int64, device=device).unsqueeze(-1)
    token_hash = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device))  # [vocab]
    bits = _mix32(_mix32(token_hash ^ key_low) ^ key_high)  # [n, vocab], uniform in [0, 2**32)
    uniform = ((bits >> (32 - _UNIFORM_BITS)).to(torch.float32) + 0.5) * 2.0**-_UNIFORM_BITS
    return -torch.log(-torch.log(uniform))

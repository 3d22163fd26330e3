"""Rank 0's sampler: turns a pass's logits into one token per row, and reads the top logits and
the log probabilities a client may ask for.

A sampled row draws with position-keyed noise: token t gets a uniform u(seed, position, t) from an
integer hash, and the draw is argmax(scaled logits + Gumbel(u)) over the tokens the filters keep (the
Gumbel-max trick; log_softmax would only shift a row by a constant). So a draw depends only on
(logits row, seed, position, params), never on which row, lane or batch it ran in. Each row is worked on alone, in float32 on the CPU with numpy: numpy's unsigned arithmetic wraps
by definition, its reductions do not split a row across threads, and the same logits draw the same
token whatever device produced them. Every argmax, greedy or sampled, breaks ties toward the lower
token id, and a row with nothing to draw from keeps its greedy token, so no decision is ever NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from tpserve.kernels.logit_adjust import adjust_logits
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.kernels.token_counts import RowTokens

__all__ = ["GUMBEL_SPAN", "sample", "sample_listed", "token_logprobs", "top_logits"]

_MASK64 = 0xFFFFFFFFFFFFFFFF
_UNIFORM_BITS = 23  # (i + 0.5) / 2**23 is exact in float32 for every i < 2**23, and never 0 or 1
# The largest Gumbel value the noise can take (u = 1 - 2**-24). A token more than this below the best
# perturbed value found so far can never win, so its noise is not worth computing.
_GUMBEL_MAX = -math.log(-math.log1p(-(2.0 ** -(_UNIFORM_BITS + 1))))
GUMBEL_SPAN = _GUMBEL_MAX + math.log(-math.log(2.0 ** -(_UNIFORM_BITS + 1)))  # max - min noise value
_NO_CANDIDATES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
_FIRST_TOP_P_BLOCK = 64  # tokens sorted first when looking for the top_p cut; grows 8x when short


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    allowed: Sequence[np.ndarray | None] | None = None,
    streams: Sequence[RowTokens | None] | None = None,
) -> list[int]:
    """One token per row of `logits` [num_rows, vocab_size], drawn as each row's params say.

    positions[i] is the position of the token row i draws; with params[i].seed it keys the noise.
    streams[i]: the tokens of row i's stream, for the logit adjustments its params ask for
    (tpserve/kernels/logit_adjust.py); None (or no `streams`) leaves the row's logits as they are.
    allowed[i], when given and not None, is row i's grammar mask (int32 words, token t at bit t % 32
    of word t // 32; tokens past its end are refused): every other token reads as -inf before the
    draw (after the adjustments), so the draw is the same function of (row, mask, seed, position)
    whatever ran beside it.
    """
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(positions) != logits.shape[0]:
        raise ValueError(
            f"sample needs logits [num_rows, vocab] and one params and position per row; got logits "
            f"{tuple(logits.shape)}, {len(params)} params, {len(positions)} positions"
        )
    adjusts = streams is not None and any(row is not None for row in streams)
    masks = allowed is not None and any(mask is not None for mask in allowed)
    if adjusts or masks:
        scores = _to_float32(logits, own=True)  # [num_rows, vocab]; the caller's logits stay raw
        if adjusts:
            adjust_logits(scores, params, streams)
        if masks:
            _mask(scores, allowed)
        # numpy documents argmax as returning the first occurrence of the maximum: the lower id.
        tokens = scores.argmax(axis=-1)  # [num_rows], the greedy choice of every row
    else:
        scores, tokens = _raw_argmax(logits)
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens.tolist()

    keys = np.array([_row_key(params[row].seed, positions[row]) for row in sampled], dtype=np.uint64)
    greedy_noise = _gumbel(keys, tokens[sampled])  # [num_sampled]
    for i, row in enumerate(sampled):
        scaled = _scaled(scores[row], params[row])
        ids, values = _candidates(
            scaled, None, len(scaled), params[row], int(tokens[row]), float(greedy_noise[i])
        )
        if len(ids):  # else the row keeps its greedy token
            # Row by row, so a row's candidates stay in cache while ~25 passes of noise run over them.
            tokens[row] = _draw(ids, values, keys[i])
    return tokens.tolist()


def sample_listed(
    greedy_ids: np.ndarray,
    rows: np.ndarray,
    ids: np.ndarray,
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
) -> list[int]:
    """sample's tokens for rows of vocab_size logits of which only a shortlist is at hand
    (tpserve/kernels/device_sampling.py): greedy_ids [num_rows], each row's argmax (NaN read as -inf); and
    the listed tokens, as rows, ids, logits [n] (float32, NaN read as -inf), ordered by row, then id.
    For a row of plain params (no mask, adjustment or log probabilities), the token is sample's on
    the whole row when the list holds every token the draw reads: each token within the Gumbel
    bound of the row's max and, for top_p with top_k, the top_k best."""
    tokens = np.array(greedy_ids, dtype=np.int64)
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens.tolist()
    keys = np.array([_row_key(params[row].seed, positions[row]) for row in sampled], dtype=np.uint64)
    greedy_noise = _gumbel(keys, tokens[sampled])  # [num_sampled]
    bounds = np.searchsorted(rows, np.arange(len(params) + 1))  # row r's tokens: bounds[r]:bounds[r + 1]
    for i, row in enumerate(sampled):
        listed = ids[bounds[row] : bounds[row + 1]]
        at = int(np.searchsorted(listed, tokens[row]))
        if at == len(listed) or listed[at] != tokens[row]:
            continue  # unlisted only when the row's max is -inf: nothing to draw from
        scaled = _scaled(logits[bounds[row] : bounds[row + 1]], params[row])
        kept, values = _candidates(scaled, listed, vocab_size, params[row], at, float(greedy_noise[i]))
        if len(kept):
            tokens[row] = _draw(kept, values, keys[i])
    return tokens.tolist()


def _draw(ids: np.ndarray, values: np.ndarray, key: np.uint64) -> int:
    """argmax of values + Gumbel noise over ids, ties between perturbed values to the lower id."""
    perturbed = values + _gumbel(key, ids)
    return int(ids[perturbed == perturbed.max()].min())


def top_logits(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k highest logits as (token id, value), highest first, equal values by lower id."""
    scores = _to_float32(logits)  # [num_rows, vocab]
    if k <= 0:
        return [[] for _ in scores]
    ids = np.arange(scores.shape[-1])
    result = []
    for row in scores:
        best_ids, best_values = _best_first(ids, row, k)
        result.append([(int(i), float(v)) for i, v in zip(best_ids, best_values)])
    return result


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row of `logits` [num_rows, vocab] with num_top[i] >= 0: the log probability of tokens[i]
    and the num_top[i] likeliest (token id, log probability), best first (equal values by lower id);
    None for rows with num_top[i] < 0. Of the raw logits (before temperature or any filter): a
    log-softmax worked in float64, so the figures are the same whatever row or batch a token ran in."""
    if logits.dim() != 2 or len(tokens) != logits.shape[0] or len(num_top) != logits.shape[0]:
        raise ValueError(
            f"token_logprobs needs logits [num_rows, vocab] and one token and count per row; got "
            f"{tuple(logits.shape)}, {len(tokens)} tokens, {len(num_top)} counts"
        )
    rows = [row for row, k in enumerate(num_top) if k >= 0]
    result: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(num_top)
    if not rows:
        return result
    scores = _to_float32(logits[rows]).astype(np.float64)  # [len(rows), vocab]
    best = scores.max(axis=-1, keepdims=True)
    log_probs = scores - (best + np.log(np.exp(scores - best).sum(axis=-1, keepdims=True)))
    ids = np.arange(scores.shape[-1])
    for i, row in enumerate(rows):
        top = []
        if num_top[row] > 0:
            top_ids, top_values = _best_first(ids, log_probs[i], num_top[row])
            top = [(int(t), float(v)) for t, v in zip(top_ids, top_values)]
        result[row] = (float(log_probs[i, tokens[row]]), top)
    return result


def _to_float32(logits: torch.Tensor, own: bool = False) -> np.ndarray:
    """The logits as a float32 array, NaN read as -inf; `own`: an array of the caller's own to
    change (copied once at most), else possibly a view of the logits."""
    scores = logits.detach().to(device="cpu", dtype=torch.float32).numpy()
    if np.isnan(scores).any():
        # A NaN logit can never win: it reads as -inf (in a copy; the caller's tensor is left alone).
        return np.where(np.isnan(scores), np.float32(-np.inf), scores)
    return scores.copy() if own else scores


def _raw_argmax(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The scores (logits as float32, NaN read as -inf) and each row's argmax, in one pass over the
    logits where no row holds a NaN: numpy's argmax returns a row's first NaN when it has one (NaN
    compares as the maximum), so a row whose argmax is not NaN has none, and `_to_float32`'s own
    pass over every logit is only needed when some row's argmax is one."""
    scores = logits.detach().to(device="cpu", dtype=torch.float32).numpy()  # [num_rows, vocab]
    tokens = scores.argmax(axis=-1)  # [num_rows]
    if np.isnan(scores[np.arange(len(tokens)), tokens]).any():
        scores = np.where(np.isnan(scores), np.float32(-np.inf), scores)
        tokens = scores.argmax(axis=-1)
    return scores, tokens


def _mask(scores: np.ndarray, allowed: Sequence[np.ndarray | None]) -> None:
    """Each masked row of scores [num_rows, vocab] (the sampler's own copy) with its refused tokens
    at -inf."""
    vocab_size = scores.shape[-1]
    for row, mask in enumerate(allowed):
        if mask is not None:
            keep = np.unpackbits(mask.astype("<i4").view(np.uint8), bitorder="little")[:vocab_size].astype(
                bool
            )
            keep = np.pad(keep, (0, vocab_size - len(keep)))  # [vocab]; past the mask: refused
            scores[row, ~keep] = -np.inf


def _scaled(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """A row's logits (float32, no NaN) divided by its temperature, in float32."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return row / np.float32(p.temperature)


def _candidates(
    scaled: np.ndarray,
    row_ids: np.ndarray | None,
    vocab_size: int,
    p: SamplingParams,
    greedy_token: int,
    greedy_noise: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of one row that the filters keep and that could win the draw.

    scaled: the row's scaled logits (_scaled): of the whole row [vocab_size] when row_ids is None,
    else of the tokens row_ids (ascending) only, a shortlist that holds every token this function
    reads (tpserve/kernels/device_sampling.py says which). greedy_token: the row's argmax, as an index into
    `scaled`. Returns (token ids, scaled values); empty when the row has nothing to draw from.
    """
    top = float(scaled[greedy_token])  # the row's max (division by a positive number keeps the order)
    if not math.isfinite(top):
        # All -inf, or overflowed to +inf by a tiny temperature: nothing to draw from.
        return _NO_CANDIDATES
    # The winner must beat the greedy token's perturbed value whenever the filters keep the greedy
    # token (and when they drop it, only tokens equal to it are left), so a token more than
    # _GUMBEL_MAX below that value can never win. The margin keeps this pruning exact under float32
    # rounding: it never changes which token wins.
    floor = top + greedy_noise - _GUMBEL_MAX - (0.01 + 1e-5 * abs(top))
    at = np.flatnonzero(scaled >= floor)  # ascending, so later ties can go to the lower id
    ids = at if row_ids is None else row_ids[at]
    values = scaled[at]

    # Every pruned token sits below every candidate, so the filters' cuts among candidates are exact.
    num_candidates = len(ids)
    if 0 < p.top_k < num_candidates:
        ids, values = _best_first(ids, values, p.top_k)
    if p.top_p < 1.0:
        if 0 < p.top_k <= num_candidates:  # all that top_k keeps is among the candidates
            kept_mass = float(np.exp(values - np.float32(top)).sum(dtype=np.float64))
        else:
            kept_mass = _kept_mass(scaled, top, p.top_k, vocab_size)
        ids, values = _top_p_prefix(ids, values, p.top_p, kept_mass, top)
    if p.min_p > 0.0:
        # p >= min_p * p_max; renormalising the kept set leaves that ratio alone, and the max is `top`.
        kept = values.astype(np.float64) - top >= math.log(p.min_p)
        ids, values = ids[kept], values[kept]
    return ids, values


def _best_first(ids: np.ndarray, values: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The m best of (ids, values): highest value first, equal values in their current order.

    Called with ids ascending (or already in this order), so equal values go to the lower id.
    """
    if m < len(values):
        # The m-th highest value is exact from a partition; keep every token tied with it too, so the
        # stable sort below decides the ties, not the partition.
        mth = np.partition(values, len(values) - m)[len(values) - m]
        chosen = np.flatnonzero(values >= mth)
        ids, values = ids[chosen], values[chosen]
    order = np.argsort(-values, kind="stable")[:m]
    return ids[order], values[order]


def _kept_mass(scaled: np.ndarray, top: float, top_k: int, vocab_size: int) -> float:
    """Sum of exp(scaled - top) over the tokens top_k keeps (all of them when top_k is 0) of a row
    of vocab_size tokens. `scaled` is the whole row, or (top_k > 0) a shortlist in id order that
    holds its top_k best: the same weights, summed in the same order."""
    weights = np.exp(scaled - np.float32(top))  # [len(scaled)], float32
    if not 0 < top_k < vocab_size:
        return float(weights.sum(dtype=np.float64))
    kth = np.partition(scaled, len(scaled) - top_k)[len(scaled) - top_k]
    above = scaled > kth
    num_at_kth = top_k - int(above.sum())  # how many of the tokens equal to kth top_k keeps
    return float(weights[above].sum(dtype=np.float64)) + num_at_kth * float(np.exp(np.float32(kth - top)))


def _top_p_prefix(
    ids: np.ndarray, values: np.ndarray, top_p: float, kept_mass: float, top: float
) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of most likely candidates whose mass reaches top_p, at least one.

    Sorts a growing block of the best candidates until the block's mass reaches top_p, rather than
    sorting the whole vocabulary: the cut falls inside the block, and the cumulative sum over a
    prefix is the same whatever follows it.
    """
    block = _FIRST_TOP_P_BLOCK
    while True:
        best_ids, best_values = _best_first(ids, values, block)
        probs = np.exp(best_values - np.float32(top)).astype(np.float64) / kept_mass
        mass_through = np.cumsum(probs)  # mass of each token and all ahead of it
        if mass_through[-1] >= top_p or len(best_ids) == len(ids):
            mass_before = np.concatenate(([0.0], mass_through[:-1]))  # nondecreasing: a prefix passes
            num_kept = max(1, int(np.count_nonzero(mass_before < top_p)))
            return best_ids[:num_kept], best_values[:num_kept]
        block *= 8


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _row_key(seed: int, position: int) -> int:
    """The 64-bit key of one draw, in exact Python integers, so any seed or position is well defined."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ (int(position) & _MASK64))


def _mix32(x: np.ndarray) -> np.ndarray:
    """Wellons' lowbias32 avalanche mix, in place on a uint32 array (whose products wrap by definition)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _gumbel(keys: np.ndarray | np.uint64, ids: np.ndarray) -> np.ndarray:
    """Gumbel noise (float32) for token ids[i] under 64-bit draw key keys[i] (or one key for all).

    Each value depends only on its (key, id) pair.
    """
    bits = ids.astype(np.uint32) ^ (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    bits = _mix32(bits)
    bits ^= (keys >> np.uint64(32)).astype(np.uint32)
    bits = _mix32(bits)
    uniform = (bits >> np.uint32(32 - _UNIFORM_BITS)).astype(np.float32)
    uniform += np.float32(0.5)
    uniform *= np.float32(2.0**-_UNIFORM_BITS)
    noise = np.log(uniform, out=uniform)
    np.negative(noise, out=noise)
    np.log(noise, out=noise)
    return np.negative(noise, out=noise)

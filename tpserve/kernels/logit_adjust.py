"""Rank 0's changes to logits before the draw: logit_bias, min_tokens' barred ids, and the penalties
(repetition over prompt and reply tokens, frequency and presence over reply tokens), in vLLM's order.

Each change is elementwise on (row, token) pairs gathered for all rows at once: one numpy op per kind
of change for the whole pass, never a loop per token. A pair's new value depends only on its old
value, its row's params and its row's stream tokens, so a row is changed the same whatever batch or
rank layout it ran in (the draw that follows is position-keyed: tpserve/kernels/sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.kernels.token_counts import RowTokens

_NO_INTS = np.zeros(0, dtype=np.int64)


def adjust_logits(
    scores: np.ndarray, params: Sequence[SamplingParams], rows: Sequence[RowTokens | None]
) -> None:
    """Change `scores` [num_rows, vocab] (float32) in place; rows[i] is None for a row left alone."""
    vocab_size = scores.shape[1]
    chosen = [i for i, row in enumerate(rows) if row is not None]
    if not chosen:
        return
    _add_bias(scores, [(i, params[i].logit_bias) for i in chosen if params[i].logit_bias])
    barred = [(i, rows[i][0].barred) for i in chosen if _is_short(rows[i])]
    if barred:
        scores[_pairs(barred)] = -np.inf
    # Reply counts per (row, token), each pair once: a Verify row's drafts merged into its counts.
    keys, counts = [], []
    for i in chosen:
        counts_of, fed = rows[i]
        ids = np.frombuffer(counts_of.reply_ids, dtype=np.int64)
        times = np.frombuffer(counts_of.reply_times, dtype=np.int64)
        if fed:
            merged: dict[int, int] = {}
            for token in fed:
                merged[token] = merged.get(token, counts_of.times(token)) + 1
            kept = ~np.isin(ids, list(merged))
            ids = np.concatenate([ids[kept], np.fromiter(merged.keys(), dtype=np.int64, count=len(merged))])
            times = np.concatenate(
                [times[kept], np.fromiter(merged.values(), dtype=np.int64, count=len(merged))]
            )
        keys.append(i * vocab_size + ids)
        counts.append(times)
    reply_keys = np.concatenate(keys)
    reply_counts = np.concatenate(counts).astype(np.float32)

    repeated = [i for i in chosen if params[i].repetition_penalty != 1.0]
    if repeated:
        # A token in both the prompt and the reply appears twice: both writes store the same value.
        prompt = [i * vocab_size + np.frombuffer(rows[i][0].prompt_ids, dtype=np.int64) for i in repeated]
        reply = [keys[chosen.index(i)] for i in repeated]
        seen = np.concatenate([*prompt, *reply])
        r, t = seen // vocab_size, seen % vocab_size
        penalty = np.array([p.repetition_penalty for p in params], dtype=np.float32)[r]
        values = scores[r, t]
        scores[r, t] = np.where(values > 0, values / penalty, values * penalty)
    if len(reply_keys):
        r, t = reply_keys // vocab_size, reply_keys % vocab_size
        frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)[r]
        presence = np.array([p.presence_penalty for p in params], dtype=np.float32)[r]
        scores[r, t] -= frequency * reply_counts + presence


def _is_short(row: RowTokens) -> bool:
    counts_of, fed = row
    return counts_of.num_output + len(fed) < counts_of.min_tokens and bool(counts_of.barred)


def _add_bias(scores: np.ndarray, biased: list[tuple[int, tuple[tuple[int, float], ...]]]) -> None:
    if not biased:
        return
    r = np.concatenate([np.full(len(bias), i, dtype=np.int64) for i, bias in biased])
    t = np.concatenate([np.array([token for token, _ in bias], dtype=np.int64) for _, bias in biased])
    v = np.concatenate([np.array([value for _, value in bias], dtype=np.float32) for _, bias in biased])
    scores[r, t] += v  # (row, token) pairs are distinct: a bias names each id once


def _pairs(rows: list[tuple[int, tuple[int, ...]]]) -> tuple[np.ndarray, np.ndarray]:
    r = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids in rows] or [_NO_INTS])
    t = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in rows] or [_NO_INTS])
    return r, t

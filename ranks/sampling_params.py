"""How one stream samples its tokens, and the log probabilities it reports: plain, torch-free values
shared by the host and the ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (ties go to the lower token id).

    top_k 0 and top_p 1.0 and min_p 0.0 turn those filters off. The seed keys the position-keyed
    noise: a draw at position p depends only on (seed, p, token id), never on the lane or batch.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    # Not how to sample but what to report of it: -1 nothing; k >= 0 each sampled token's log
    # probability and its k likeliest alternatives (TokenLogprob), computed on rank 0 only.
    logprobs: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability under the model's raw logits, and the likeliest tokens at
    its position as (token id, log probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

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
    # Changes to a row's logits before any of the above (tpserve/kernels/logit_adjust.py), as vLLM applies
    # them: logit_bias, then repetition_penalty over prompt and reply tokens, then frequency and
    # presence penalties over reply tokens. They need the stream's tokens (tpserve/kernels/token_counts.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a row's logits change before the draw (its stream then keeps TokenCounts)."""
        penalized = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        return penalized or self.repetition_penalty != 1.0 or bool(self.logit_bias)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability under the model's raw logits, and the likeliest tokens at
    its position as (token id, log probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

"""The fake backend's tokens: its vocabulary (multi-letter pieces, so stop strings cross token
boundaries; token 0 the EOS; a token outside it that detokenizing refuses) and how a token is drawn
from a lane's whole history, so any rollback, position slip or cross-talk changes the reply.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpserve.kernels.sampling_params import SamplingParams

MASK_64 = (1 << 64) - 1
EOS_ID = 0
# Token pieces: multi-letter so stop strings can cross token boundaries. Token 0 is EOS.
PIECES = ("", *[c + v for c in "bdfgklmnprst" for v in "aeiou"][:38], " ")
VOCAB_SIZE = len(PIECES)
BAD_TOKEN = VOCAB_SIZE  # outside the vocabulary: fake_detokenize refuses it
EOS_IDS = frozenset({EOS_ID})


def fake_detokenize(ids: Sequence[int]) -> str:
    for token in ids:
        if not 0 <= token < VOCAB_SIZE:
            raise ValueError(f"token {token} is outside the vocabulary")
    return "".join(PIECES[token] for token in ids)


def mix(value: int) -> int:
    """splitmix64's finalizer: every input bit moves every output bit."""
    value = (value + 0x9E3779B97F4A7C15) & MASK_64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK_64
    return value ^ (value >> 31)


def draw(history: Sequence[int], sampling: SamplingParams, repeat_period: int, break_period: int) -> int:
    """The value the token after `history` is drawn from (the token: its value % VOCAB_SIZE): a
    rolling hash of every (position, token) in it; a sampled request mixes in noise keyed by (seed,
    position) only, as the real sampler does."""
    position = len(history)  # where the sampled token will go
    value = 0
    for at, token in enumerate(history):
        value = mix(value ^ ((at << 32) | (token & 0xFFFFFFFF)))
    breaks = break_period and position % break_period == 0
    if repeat_period and len(history) >= repeat_period and not breaks:
        # A model that repeats itself: what prompt lookup guesses (sampled rows still draw).
        value = history[-repeat_period] + VOCAB_SIZE * (value >> 32)
    if not sampling.greedy:
        value = mix(value ^ mix((sampling.seed << 24) ^ position))
    return value


def top_features(value: int) -> list[tuple[int, float]]:
    """The top logits a draw's value stands for: three (token, logit) pairs."""
    return [((value >> (8 * i)) % VOCAB_SIZE, ((value >> (8 * i + 4)) % 1000) / 100) for i in range(3)]

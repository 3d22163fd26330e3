"""How one stream samples its tokens: a plain, torch-free value shared by the host and the ranks."""

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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

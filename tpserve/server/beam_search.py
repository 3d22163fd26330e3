"""Beam search (vLLM's `use_beam_search`): the `width` likeliest replies by their tokens' summed log
probabilities, ranked at the end by that sum over the reply's length to the `length_penalty`.

Plain Python over a `step` that, given every live beam's tokens, answers each beam's candidates for
its next token: (token id, log probability) pairs, the likeliest first (tpserve/server/beam_steps.py asks the
engine for them). Each step keeps the `width` best grown beams; a beam whose new token ends the
sequence is set aside as finished, as vLLM's search does, and the search goes on until `max_tokens`
steps or no live beam is left. Ties go to the lower token ids, so a search's answer depends on the
step's figures alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

Candidates = Sequence[tuple[int, float]]  # (token id, log probability), the likeliest first


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]  # the reply so far
    logprob: float  # the sum of its tokens' log probabilities
    ended: bool = False  # its last token ends the sequence (an end-of-sequence token)

    def score(self, length_penalty: float) -> float:
        """The final ranking: the summed log probability over the reply's length (an ending token
        not counted) to the length_penalty; above 1 favours longer replies, below 1 shorter."""
        length = max(1, len(self.token_ids) - int(self.ended))
        return self.logprob / length**length_penalty


@dataclass(frozen=True)
class BeamResult:
    """One prompt's search: the prompt that ran and its best beams, best first."""

    prompt_ids: tuple[int, ...]
    beams: tuple[Beam, ...]


@dataclass(frozen=True)
class BeamSettings:
    width: int  # beams kept per step, and replies answered (the request's n)
    max_tokens: int  # steps at most
    length_penalty: float = 1.0
    ignore_eos: bool = False  # an end-of-sequence token is a token like any other


def search(
    step: Callable[[list[tuple[int, ...]]], list[Candidates]],
    settings: BeamSettings,
    eos_ids: Collection[int],
) -> list[Beam]:
    """The best `settings.width` beams, best first."""
    live = [Beam((), 0.0)]
    finished: list[Beam] = []
    for _ in range(settings.max_tokens):
        grown: list[Beam] = []
        for beam, candidates in zip(live, step([beam.token_ids for beam in live])):
            for token_id, logprob in candidates:
                ends = token_id in eos_ids and not settings.ignore_eos
                child = Beam((*beam.token_ids, token_id), beam.logprob + logprob, ends)
                (finished if ends else grown).append(child)
        live = sorted(grown, key=lambda beam: (-beam.logprob, beam.token_ids))[: settings.width]
        if not live:
            break
    ranked = sorted(finished + live, key=lambda beam: (-beam.score(settings.length_penalty), beam.token_ids))
    return ranked[: settings.width]

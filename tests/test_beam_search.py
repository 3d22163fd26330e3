"""Beam search's ranking (tpserve/server/beam_search.py), against a fake model whose every next-token
distribution depends on the whole history, so any slip in how beams grow shows."""

from __future__ import annotations

import itertools
import math
import random

from tpserve.server.beam_search import Beam, BeamSettings, search

VOCAB = 4
EOS = 3


def fake_logprobs(history: tuple[int, ...]) -> list[float]:
    """A normalized distribution over VOCAB tokens, drawn from the history itself."""
    rng = random.Random(hash(history))
    weights = [rng.random() ** 3 + 1e-3 for _ in range(VOCAB)]
    total = sum(weights)
    return [math.log(w / total) for w in weights]


def step_of(num_candidates: int):
    calls = []

    def step(beams):
        calls.append(list(beams))
        answers = []
        for beam in beams:
            ranked = sorted(enumerate(fake_logprobs(beam)), key=lambda item: (-item[1], item[0]))
            answers.append(ranked[:num_candidates])
        return answers

    return step, calls


def exhaustive_best(max_tokens: int, length_penalty: float, ignore_eos: bool) -> Beam:
    """Every reply of up to max_tokens tokens (one ending at its first EOS, unless ignored), scored."""
    replies = []
    for length in range(1, max_tokens + 1):
        for tokens in itertools.product(range(VOCAB), repeat=length):
            ends_at = [i for i, t in enumerate(tokens) if t == EOS]
            if not ignore_eos and ends_at and ends_at[0] != length - 1:
                continue  # the search would have ended it at its first EOS
            ended = not ignore_eos and tokens[-1] == EOS
            if not ended and length < max_tokens:
                continue  # a live beam runs to max_tokens
            logprob = sum(fake_logprobs(tokens[:i])[t] for i, t in enumerate(tokens))
            replies.append(Beam(tokens, logprob, ended))
    return min(replies, key=lambda beam: (-beam.score(length_penalty), beam.token_ids))


def test_a_wide_enough_search_finds_the_best_reply_of_all():
    # Width VOCAB**(max_tokens-1) keeps every live prefix, so the search is exhaustive.
    for length_penalty in (0.0, 1.0, 2.0):
        for ignore_eos in (False, True):
            settings = BeamSettings(
                width=VOCAB**2, max_tokens=3, length_penalty=length_penalty, ignore_eos=ignore_eos
            )
            step, _ = step_of(2 * settings.width)
            best = search(step, settings, {EOS})[0]
            expected = exhaustive_best(3, length_penalty, ignore_eos)
            assert best.token_ids == expected.token_ids and math.isclose(best.logprob, expected.logprob)


def test_width_one_is_greedy_and_beams_come_best_first_and_distinct():
    step, _ = step_of(2)
    (greedy,) = search(step, BeamSettings(width=1, max_tokens=6, ignore_eos=True), {EOS})
    history: tuple[int, ...] = ()
    for _ in range(6):
        scores = fake_logprobs(history)
        history += (max(range(VOCAB), key=lambda t: (scores[t], -t)),)
    assert greedy.token_ids == history
    step, calls = step_of(6)
    beams = search(step, BeamSettings(width=3, max_tokens=5), {EOS})
    assert len({beam.token_ids for beam in beams}) == 3
    scores = [beam.score(1.0) for beam in beams]
    assert scores == sorted(scores, reverse=True)
    assert all(len(live) <= 3 for live in calls)  # never more live beams than the width
    for beam in beams:  # each beam's figure is its own tokens' log probabilities, summed
        expected = sum(fake_logprobs(beam.token_ids[:i])[t] for i, t in enumerate(beam.token_ids))
        assert math.isclose(beam.logprob, expected)
        assert beam.ended == (beam.token_ids[-1] == EOS) and EOS not in beam.token_ids[:-1]


def test_an_ending_token_sets_its_beam_aside_as_finished():
    def step(beams):
        return [[(EOS, -0.1), (0, -5.0)] for _ in beams]

    beams = search(step, BeamSettings(width=1, max_tokens=10), {EOS})
    assert beams == [Beam((EOS,), -0.1, True)]
    # With the ending token ignored, the beam runs the whole budget.
    (long,) = search(step, BeamSettings(width=1, max_tokens=4, ignore_eos=True), {EOS})
    assert long.token_ids == (EOS,) * 4 and not long.ended

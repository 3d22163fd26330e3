"""Draft tokens for a decode round, by prompt lookup: what followed the last few tokens before.

Text often repeats what came earlier (a name, a quoted line, code being edited). When the last
`n` tokens of a stream's history also occur earlier in it, the tokens that followed them there
are a guess at what comes next. The host has the engine check the guesses in the same pass as the
stream's next token; with batch-invariant products a checked guess changes no token: the reply is
the one plain decoding gives. No model is needed, and a wrong guess only costs its rows (nearly
nothing where float products are padded to 16 rows anyway; more in int8, hence `_Reach`).
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Sequence

MAX_MATCH = 4  # the longest suffix looked up first
MIN_MATCH = 2  # a single repeated token predicts too little


def propose(history: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """max_tokens tokens that followed the latest earlier occurrence of the history's last n tokens
    (n from MAX_MATCH down to MIN_MATCH), the repetition carried on past the history's end; () when
    none recurs."""
    if max_tokens <= 0 or len(history) <= MIN_MATCH:
        return ()
    tokens = array("q", history)
    raw = tokens.tobytes()
    width = tokens.itemsize
    for n in range(min(MAX_MATCH, len(history) - 1), MIN_MATCH - 1, -1):
        suffix = raw[-n * width :]
        end = len(raw) - width  # an occurrence must end before the history's last token
        while True:
            at = raw.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % width == 0:  # a match on token boundaries, not inside two tokens' bytes
                return _continue(history, at // width + n, max_tokens)
            end = at + len(suffix) - 1
    return ()


def _continue(history: Sequence[int], first: int, max_tokens: int) -> tuple[int, ...]:
    """history[first:], and past the end of the history the same repetition carried on (a match
    close to the end would otherwise guess only a few tokens of a text that keeps repeating)."""
    extended = list(history)
    for source in range(first, first + max_tokens):
        extended.append(extended[source])
    return tuple(extended[len(history) :])


class Drafter:
    """Chooses each live stream's drafts for a round, and counts what the engine accepted.

    A round feeds at most `num_rows` tokens, shared evenly: a stream's drafts never run past its
    KV reservation or its max_tokens. Checking a draft is not free (a quantized product computes
    every row it is given: int8, one lane, 15 drafts cost 2.3x a plain step in CPU time), so a
    stream whose guesses keep failing guesses less: each round that keeps none of its drafts halves
    its reach, a round that keeps them all doubles it (up to max_draft_tokens), and at zero it rests
    RETRY_AFTER rounds before guessing one token again.
    """

    def __init__(self, max_draft_tokens: int, num_rows: int):
        self.max_draft_tokens = max_draft_tokens
        self.num_rows = num_rows
        self.num_drafted = 0
        self.num_accepted = 0
        self._streams: weakref.WeakKeyDictionary[object, _Reach] = weakref.WeakKeyDictionary()

    def drafts(self, jobs) -> list[tuple[int, ...]]:
        """One draft per job (maybe empty); `jobs` are a round's live jobs, at least one. Reads only:
        a plan may ask twice; `advance` counts the round once it runs."""
        out = []
        for job, tokens in zip(jobs, self._reaches(jobs)):
            if tokens is None:
                out.append(())
                continue
            room = min(job.reserve - job.next_position, job.request.max_tokens - len(job.produced)) - 1
            out.append(propose(job.feed_ids, min(tokens, room)))
        return out

    def advance(self, jobs) -> None:
        """The round `drafts(jobs)` planned runs: each guessing stream's reach moves on (a resting
        one rests a round more)."""
        if self._per_job(jobs) <= 0:
            return
        for job in jobs:
            if job.matcher is None:
                self._streams.setdefault(job, _Reach(self.max_draft_tokens)).next_round()

    def _per_job(self, jobs) -> int:
        return min(self.max_draft_tokens, (self.num_rows - len(jobs)) // len(jobs))

    def _reaches(self, jobs) -> list[int | None]:
        """Per job, the most draft tokens it may guess this round; None where it guesses none."""
        per_job = self._per_job(jobs)
        if per_job <= 0:
            return [None] * len(jobs)
        # A draft token would be verified against logits that no grammar masked; a constrained
        # stream decodes one token a round instead.
        return [
            None
            if job.matcher is not None
            else min(per_job, self._streams.get(job, _Reach(self.max_draft_tokens)).upcoming()[0])
            for job in jobs
        ]

    def kept(self, job, draft: tuple[int, ...], tokens: list[int]) -> list[int]:
        """The sampled tokens up to and including the first that differs from the next draft."""
        num_kept = count_kept(draft, tokens)
        self.num_drafted += len(draft)
        self.num_accepted += num_kept - 1
        reach = self._streams.get(job)
        if reach is not None:
            reach.checked(len(draft), num_kept - 1)
        return tokens[:num_kept]


RETRY_AFTER = 8  # rounds a stream rests once its reach fell to zero


class _Reach:
    """How many draft tokens one stream may have checked next (0: resting)."""

    def __init__(self, most: int):
        self.most = most
        self.tokens = most  # a stream starts at the most it may
        self.resting = 0

    def upcoming(self) -> tuple[int, int]:
        """(tokens, resting) after the next round's start, changing nothing."""
        if self.tokens == 0:
            if self.resting + 1 > RETRY_AFTER:
                return 1, 0
            return 0, self.resting + 1
        return self.tokens, self.resting

    def next_round(self) -> int:
        self.tokens, self.resting = self.upcoming()
        return self.tokens

    def checked(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:  # nothing recurred: no evidence either way
            return
        if num_accepted == num_drafted:
            self.tokens = min(self.most, 2 * self.tokens)
        elif num_accepted == 0:
            self.tokens //= 2


def count_kept(draft: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of a Verify's samples a stream keeps: up to and including the first sample that
    differs from the next draft (tokens[i] was sampled after feeding the first i drafts)."""
    num_kept = 1
    while num_kept <= len(draft) and tokens[num_kept - 1] == draft[num_kept - 1]:
        num_kept += 1
    return num_kept

"""One stream's tokens as the logit adjustments read them: its prompt's distinct ids, how often each
reply token came, and which ids are barred until the reply has min_tokens tokens.

Kept per stream, not per lane, by the lane host's job (a stream may leave its lane and resume on
another), and handed to rank 0's sampler with each item; plain Python, so the lane host needs no
numpy or torch. Only the tokens the host accepted are counted: a rejected draft never is. The ids
and counts live in int64 `array`s that rank 0 reads without copying (numpy.frombuffer), updated in
O(1) per token.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable


class TokenCounts:
    def __init__(self, prompt_ids: Iterable[int], *, min_tokens: int = 0, barred: Iterable[int] = ()):
        self.prompt_ids = array("q", sorted(set(prompt_ids)))  # distinct, for repetition_penalty
        self.reply_ids = array("q")  # each reply token id once, in the order first sampled
        self.reply_times = array("q")  # reply_times[i]: how often reply_ids[i] was sampled
        self._where: dict[int, int] = {}  # token id -> its index in reply_ids
        self.num_output = 0
        self.min_tokens = min_tokens
        self.barred = tuple(sorted(set(barred)))  # EOS and stop_token_ids: -inf while the reply is short

    def add(self, token_id: int) -> None:
        at = self._where.get(token_id)
        if at is None:
            self._where[token_id] = len(self.reply_ids)
            self.reply_ids.append(token_id)
            self.reply_times.append(1)
        else:
            self.reply_times[at] += 1
        self.num_output += 1

    def times(self, token_id: int) -> int:
        """How often the reply sampled token_id so far."""
        at = self._where.get(token_id)
        return 0 if at is None else self.reply_times[at]


# One logits row's view of its stream: the counts, and the tokens this pass fed after them (a
# Verify row's drafts before it), which count as reply tokens for that row only.
RowTokens = tuple[TokenCounts, tuple[int, ...]]

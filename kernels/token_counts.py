"""One stream's tokens as the logit adjustments read them: its prompt's distinct ids, how often each
reply token came, and which ids are barred until the reply has min_tokens tokens.

Kept per stream, not per lane, by the lane host's job (a stream may leave its lane and resume on
another), and handed to rank 0's sampler with each item; plain Python, so the lane host needs no
numpy or torch. Only the tokens the host accepted are counted: a rejected draft never is.
"""

from __future__ import annotations

from collections.abc import Iterable


class TokenCounts:
    def __init__(self, prompt_ids: Iterable[int], *, min_tokens: int = 0, barred: Iterable[int] = ()):
        self.prompt_ids = tuple(sorted(set(prompt_ids)))  # distinct, for repetition_penalty
        self.output: dict[int, int] = {}  # reply token id -> times sampled
        self.num_output = 0
        self.min_tokens = min_tokens
        self.barred = tuple(sorted(set(barred)))  # EOS and stop_token_ids: -inf while the reply is short

    def add(self, token_id: int) -> None:
        self.output[token_id] = self.output.get(token_id, 0) + 1
        self.num_output += 1


# One logits row's view of its stream: the counts, and the tokens this pass fed after them (a
# Verify row's drafts before it), which count as reply tokens for that row only.
RowTokens = tuple[TokenCounts, tuple[int, ...]]

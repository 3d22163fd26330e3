"""Turns one reply's sampled tokens into text deltas, holding back what must not be sent yet.

Incremental detokenization: each new token is decoded together with a few tokens before it (so a
tokenizer that drops a leading space on a lone token still gets it right) and only the new
characters are kept. Text is held back while:
- the decode ends in U+FFFD (an incomplete UTF-8 sequence whose next bytes are still to come);
- its end could still be the start of a stop string.
A token that adds no text at all (a special token, skipped) is released at once, with none: its id
goes out with the step that sampled it, not with the next visible text.
A stop string is matched on the reply's text across token boundaries; the matched text and anything
after it is never released. Token ids travel with their text: a token is released once text it
produced is released (a token whose text straddles a stop string's start is released, cut).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_TOKENS = 4  # prompt tokens decoded ahead of the reply's first token, for its spacing


@dataclass(frozen=True)
class TextOut:
    """What one push or the final flush releases (possibly nothing)."""

    token_ids: tuple[int, ...]
    text: str

    def __bool__(self) -> bool:
        return bool(self.token_ids or self.text)


class TextStream:
    def __init__(
        self,
        detokenize: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
        context_ids: Sequence[int] = (),
        include_stop: bool = False,
    ):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._detokenize = detokenize
        self._stop = tuple(stop)
        self._include_stop = include_stop  # a matched stop string is released, and nothing after it
        context = list(context_ids[-NUM_CONTEXT_TOKENS:]) if context_ids else []
        self._num_context = len(context)
        self._ids: list[int] = context  # context, then every reply token pushed
        self._prefix_offset = 0  # decode window: ids[prefix_offset:read_offset] is already text
        self._read_offset = len(context)
        self._text = ""  # the reply's decoded text so far
        self._token_ends: list[int] = []  # per decoded reply token: len(self._text) after it
        self._num_chars_sent = 0
        self._num_tokens_sent = 0
        self.stopped = False  # a stop string matched: nothing more will be released

    @property
    def num_tokens(self) -> int:
        return len(self._ids) - self._num_context

    def push(self, token_id: int) -> TextOut:
        """Add one sampled token; returns what can be released now."""
        if self.stopped:
            raise RuntimeError("push after a stop string matched")
        self._ids.append(token_id)
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> TextOut:
        """The reply ends (EOS or max_tokens): release everything still held, stop strings still cut."""
        if self.stopped:
            return TextOut((), "")
        self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        if self._read_offset == len(self._ids):
            return
        before = self._detokenize(self._ids[self._prefix_offset : self._read_offset])
        after = self._detokenize(self._ids[self._prefix_offset :])
        silent = after == before  # tokens with no text at all (a special token the reply skips)
        if not final and not silent and (len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR)):
            # Nothing new yet, or a character whose bytes are split over tokens still to come.
            return
        # Silent tokens are decoded as nothing, so they go out now, not with the next visible text;
        # the window keeps its start then, so the next token is still decoded after the text before them.
        self._text += after[len(before) :]
        self._token_ends += [len(self._text)] * (self.num_tokens - len(self._token_ends))
        if not silent:
            self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _release(self, final: bool) -> TextOut:
        pending = self._text[self._num_chars_sent :]
        # Any stop match starts at or after num_chars_sent: text that could begin one is never sent.
        found = [(at, -len(s)) for at, s in ((pending.find(s), s) for s in self._stop) if at >= 0]
        if found:
            self.stopped = True
            match, minus_length = min(found)  # the earliest match, the longest of those
            cut = self._num_chars_sent + match + (-minus_length if self._include_stop else 0)
        elif final:
            cut = len(self._text)
        else:
            cut = len(self._text) - self._held_for_stop(pending)
        num_tokens = self._num_tokens_sent
        while num_tokens < len(self._token_ends):
            start = self._token_ends[num_tokens - 1] if num_tokens else 0
            if not (start < cut or self._token_ends[num_tokens] <= cut):
                break
            num_tokens += 1
        if final and not self.stopped:
            num_tokens = len(self._token_ends)
        first_token = self._num_context + self._num_tokens_sent
        out = TextOut(
            tuple(self._ids[first_token : self._num_context + num_tokens]),
            self._text[self._num_chars_sent : cut],
        )
        self._num_tokens_sent = num_tokens
        self._num_chars_sent = cut
        return out

    def _held_for_stop(self, pending: str) -> int:
        """Length of the longest end of `pending` that is the start of some stop string."""
        held = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(pending)), held, -1):
                if pending.endswith(stop[:length]):
                    held = length
                    break
        return held

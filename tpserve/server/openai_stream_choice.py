"""One streamed choice's chunks on their way out: which chunk carries its finish reason, and the usage
each chunk carries. Plain dicts in, plain dicts out; nothing here reads a stream or waits.

OpenAI and vLLM put a choice's finish reason in the chunk with its last text, not in an empty chunk
after it. A reader learns that a delta was the last only from the stream's Finished, which mostly
comes in the same read of the stream and sometimes in the next. So each read's newest chunk is held
to the end of that read, and past it while the reply may be over: once it has reached max_tokens
(the host then ends it at the same boundary, so nothing waits for another token). A reply that
ends after its last chunk went out (a stop token sampled in a later round) gets its reason in an
empty chunk, as OpenAI's do when the last token has no text.

With vLLM's stream_options.continuous_usage_stats every chunk carries the choice's usage so far;
with return_token_ids the choice's first chunk carries its prompt's token ids (as vLLM's does: in
the choice for completions, beside the choices for a chat).
"""

from __future__ import annotations

from tpserve.server.requests import Usage


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChoiceChunks:
    def __init__(
        self,
        prompt_ids: tuple[int, ...],
        max_tokens: int,
        *,
        continuous_usage: bool = False,
        return_token_ids: bool = False,
        chat: bool = False,
    ):
        self._prompt_ids = prompt_ids
        self._max_tokens = max_tokens
        self._continuous_usage = continuous_usage
        self._prompt_ids_due = return_token_ids  # until the choice's first chunk has gone out
        self._chat = chat  # a chat chunk carries them beside its choices, a completion's in its choice
        self._held: dict | None = None
        self._num_tokens = 0  # reply tokens so far (every sampled one, as usage counts them)

    def count(self, num_tokens: int) -> None:
        self._num_tokens += num_tokens

    def now(self, chunk: dict) -> dict:
        """A chunk that is never the last (the chat's role, an echo sent before any token): out now."""
        return self._stamped(chunk, self._num_tokens)

    def add(self, chunk: dict) -> list[dict]:
        """The next chunk: held; the chunks to send now (the one held before it)."""
        out = [] if self._held is None else [self._held]
        self._held = self._stamped(chunk, self._num_tokens)
        return out

    def end_read(self) -> list[dict]:
        """The read of the stream is over: the held chunk goes, unless the reply may be over."""
        if self._held is None or self._num_tokens >= self._max_tokens:
            return []
        out, self._held = [self._held], None
        return out

    def finish(self, reason_chunk: dict, usage: Usage) -> list[dict]:
        """The stream's Finished: the held chunk takes `reason_chunk`'s finish reason, or
        `reason_chunk` (empty, with the reason) goes itself; with the reply's final usage."""
        chunk = reason_chunk
        if self._held is not None:
            chunk, self._held = self._held, None
            chunk["choices"][0]["finish_reason"] = reason_chunk["choices"][0]["finish_reason"]
        else:
            chunk = self._stamped(chunk, usage.completion_tokens)
        if self._continuous_usage:
            chunk["usage"] = running_usage(usage.prompt_tokens, usage.completion_tokens)
        return [chunk]

    def _stamped(self, chunk: dict, num_tokens: int) -> dict:
        if self._prompt_ids_due:
            (chunk if self._chat else chunk["choices"][0])["prompt_token_ids"] = list(self._prompt_ids)
            self._prompt_ids_due = False
        if self._continuous_usage:
            chunk["usage"] = running_usage(len(self._prompt_ids), num_tokens)
        return chunk

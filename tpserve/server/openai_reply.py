"""The OpenAI objects one reply is answered with: whole (chat.completion, text_completion) or as
streamed chunks, its usage and its log probabilities. Plain dicts, ready for JSON; nothing here
waits or decides."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence

from tpserve.server.openai_prompt_logprobs import echoed_logprobs, vllm_prompt_logprobs
from tpserve.server.requests import CANCELLED, LENGTH, STOP, Prefilled, TokenLogprob, Usage

TOOL_CALLS = "tool_calls"  # the reply ended in tool calls (a chat's finish reason only)
FINISH_REASONS = {STOP: "stop", LENGTH: "length", CANCELLED: "cancelled", TOOL_CALLS: "tool_calls"}
# The fields of OpenAI's chat.completion and assistant message this server never fills, present as
# null (as OpenAI's replies have them), so a raw reply reads as the openai package's model of it.
CHAT_NULLS = {"service_tier": None, "metadata": None, "moderation": None}  # a chat.completion's
MESSAGE_NULLS = {
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "tool_calls": None,
}


def openai_message(message: dict) -> dict:
    """An assistant message (role, content and what the reply's parser found) with OpenAI's other
    fields null."""
    return {**MESSAGE_NULLS, **message}


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ReplyShape:
    """One reply's id, model and kind, and the objects that carry it."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        return_token_ids: bool,
        logprobs: bool = False,
        token_text: Callable[[int], str] = str,
        echo_logprobs: bool = False,
        prompt_logprobs: bool = False,
    ):
        self.chat = chat
        self.model = model
        self.return_token_ids = return_token_ids
        self.logprobs = logprobs  # the request asked for them
        self._token_text = token_text  # one token id's text, for the logprobs' `token` fields
        self.echo_logprobs = echo_logprobs  # the prompt's log probabilities lead a completion's
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs list
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(
        self,
        text: str,
        token_ids: list[int],
        reason: str,
        usage: Usage,
        logprobs: Sequence[TokenLogprob] = (),
    ) -> dict:
        return self.whole_of([self.choice(0, text, token_ids, reason, logprobs)], usage)

    def whole_of(self, choices: list[dict], usage: Usage) -> dict:
        """The whole reply: its choices (in index order) and the request's usage; a chat's prompt
        log probabilities beside its choices (one prompt for them all, where vLLM puts them)."""
        kind = "chat.completion" if self.chat else "text_completion"
        whole = {**self._object(kind, choices), "usage": usage_json(usage), "system_fingerprint": None}
        if self.chat:
            whole.update(CHAT_NULLS)
            prompt_rows = [choice.pop("prompt_logprobs", None) for choice in choices]
            whole["prompt_logprobs"] = prompt_rows[0] if prompt_rows else None
        return whole

    def choice(
        self, index: int, text: str, token_ids: list[int], reason: str, logprobs: Sequence[TokenLogprob] = ()
    ) -> dict:
        choice: dict = {
            "index": index,
            "finish_reason": FINISH_REASONS[reason],
            "logprobs": self._logprobs(logprobs),
        }
        if self.chat:
            choice["message"] = openai_message({"role": "assistant", "content": text})
        else:
            choice["text"] = text
            choice["prompt_logprobs"] = None  # vLLM's field, always present (with_prompt fills it)
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def chunk(
        self,
        text: str,
        token_ids: tuple[int, ...] = (),
        reason: str | None = None,
        logprobs: Sequence[TokenLogprob] = (),
        index: int = 0,
    ) -> dict:
        """A streamed piece of choice `index`: new text (the chat's first piece names the role), or
        the finish reason."""
        choice: dict = {"index": index, "finish_reason": None if reason is None else FINISH_REASONS[reason]}
        if self.chat:
            choice["delta"] = {} if reason is not None else {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs) if reason is None else None
        if self.return_token_ids and reason is None:
            choice["token_ids"] = list(token_ids)
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def delta_chunk(
        self,
        delta: dict,
        token_ids: tuple[int, ...] = (),
        logprobs: Sequence[TokenLogprob] = (),
        index: int = 0,
    ) -> dict:
        """A streamed chat piece carrying `delta` (content, reasoning_content or tool_calls)."""
        chunk = self.chunk("", token_ids, logprobs=logprobs, index=index)
        chunk["choices"][0]["delta"] = delta
        return chunk

    def first_chunk(self, index: int = 0) -> dict:
        """The chat's opening piece: the role, no text yet (as OpenAI's own streams begin)."""
        chunk = self.chunk("", index=index)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return chunk

    def usage_chunk(self, usage: Usage) -> dict:
        """stream_options.include_usage: a last piece with no choices, only the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._object(kind, []), "usage": usage_json(usage)}

    @property
    def wants_prompt(self) -> bool:
        """The reply shows the prompt's log probabilities (read from the stream's Prefilled)."""
        return self.echo_logprobs or self.prompt_logprobs

    def with_prompt(self, choice: dict, prefilled: Prefilled | None) -> dict:
        """A choice (or a streamed chunk's) with the prompt's log probabilities, where asked."""
        if prefilled is None or not self.wants_prompt:
            return choice
        if self.echo_logprobs:
            choice["logprobs"] = echoed_logprobs(prefilled, choice.get("logprobs"), self._token_text)
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prefilled, self._token_text)
            if self.return_token_ids:
                choice["prompt_token_ids"] = list(prefilled.prompt_ids)
        return choice

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict | None:
        """OpenAI's shape: chat's `content` entries, or the completions API's parallel lists."""
        if not self.logprobs:
            return None
        text = self._token_text
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in logprobs], "refusal": None}
        offsets, at = [], 0
        for lp in logprobs:
            offsets.append(at)
            at += len(text(lp.token_id))
        return {
            "tokens": [text(lp.token_id) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            # OpenAI's contract: the sampled token is among each position's top entries (K + 1 at most).
            "top_logprobs": [
                {**{text(t): v for t, v in lp.top}, text(lp.token_id): lp.logprob} for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, lp: TokenLogprob) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            token = self._token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "token_id": token_id}

        return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}

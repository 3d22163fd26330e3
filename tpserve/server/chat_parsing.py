"""How this server reads its chat replies, chosen once from the chat template and the flags: the
tool-call family, `<think>` reasoning (tpserve/server/chat_reply.py) or gpt-oss's harmony channels
(tpserve/server/harmony.py), and what a chat request needs for the reader it gets."""

from __future__ import annotations

from tpserve.server.chat_reply import ChatReply, prompt_opens_think, thinks
from tpserve.server.harmony import HarmonyReply
from tpserve.server.harmony_requests import prepare, stop_ids, with_effort
from tpserve.server.openai_request import OpenAIRequest, parse_chat
from tpserve.server.tool_calls import parser_for_template


class ChatParsing:
    def __init__(self, tokenizer, tool_call_parser: str = "", reasoning_parser: str = ""):
        """The parsers: "" reads the family from the chat template, "none" turns it off."""
        template = tokenizer.chat_template
        parser = tool_call_parser or parser_for_template(template)
        self.tool_parser = None if parser == "none" else parser
        # Harmony is a format, not only a way of thinking: a template that writes it gets it unless
        # the flags name a <think> parser.
        self.harmony = (
            reasoning_parser == "gpt_oss"
            or tool_call_parser == "harmony"
            or (reasoning_parser in ("", "none") and parser_for_template(template) == "harmony")
        )
        if self.tool_parser == "harmony" and not self.harmony:
            self.tool_parser = None  # a <think> parser named for a harmony template: no harmony calls
        self._reasoning = reasoning_parser != "none"
        self._thinks = not self.harmony and (self._reasoning if reasoning_parser else thinks(template))
        self._starts_thinking = reasoning_parser == "deepseek_r1" or (
            self._thinks and prompt_opens_think(tokenizer)
        )
        self._stop_ids = stop_ids(tokenizer) if self.harmony else ()

    def parse_chat(self, body: dict, default_temperature: float | None = None) -> OpenAIRequest:
        """`default_temperature`: an unset temperature's (openai_request.parse_chat)."""
        parsed = parse_chat(
            with_effort(body) if self.harmony else body, self.tool_parser, default_temperature
        )
        if self.harmony:
            for choice in parsed.choices:
                prepare(choice, self._stop_ids)
        return parsed

    def replies(self, parsed: OpenAIRequest, count: int) -> list[ReplyReader | None]:
        """Per choice, the reader of tool calls and reasoning, where the chat can have either."""
        readers = self._readers(parsed, count)
        if parsed.include_reasoning:
            return readers
        return [None if reader is None else WithoutReasoning(reader) for reader in readers]

    def _readers(self, parsed: OpenAIRequest, count: int) -> list[ChatReply | HarmonyReply | None]:
        if not parsed.chat:
            return [None] * count
        if self.harmony:
            tools = parsed.tools if self.tool_parser == "harmony" else None
            return [HarmonyReply(tools, self._reasoning) for _ in range(count)]
        if parsed.tools is None and not self._thinks:
            return [None] * count
        return [ChatReply(parsed.tools, self._thinks, self._starts_thinking) for _ in range(count)]


class WithoutReasoning:
    """A chat reply's reader whose reasoning is read out and dropped (vLLM's include_reasoning:
    false): the content and tool calls are what the reader gives with it."""

    def __init__(self, reader: ChatReply | HarmonyReply):
        self._reader = reader

    def push(self, text: str) -> list[dict]:
        return _without_reasoning(self._reader.push(text))

    def finish(self) -> tuple[list[dict], bool]:
        deltas, called = self._reader.finish()
        return _without_reasoning(deltas), called

    def whole(self, text: str) -> tuple[dict, bool]:
        message, called = self._reader.whole(text)
        message.pop("reasoning_content", None)
        return message, called


def _without_reasoning(deltas: list[dict]) -> list[dict]:
    kept = ({key: value for key, value in delta.items() if key != "reasoning_content"} for delta in deltas)
    return [delta for delta in kept if delta]


# What reads a chat reply's text into OpenAI's deltas and message (push, finish, whole).
ReplyReader = ChatReply | HarmonyReply | WithoutReasoning

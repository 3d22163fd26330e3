"""gpt-oss's harmony format read out of a chat reply: each message's channel says where its text goes
(`analysis` -> reasoning_content, `final` and a recipient-less `commentary` -> content) and a
message addressed `to=functions.NAME` is a tool call whose body is the JSON arguments.

The reply text keeps its special tokens (the chat API asks for them, tpserve/server/http_api.py), since they
are the structure: the generation prompt ends `<|start|>assistant`, so a reply reads
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`, ending at
`<|return|>` or, after a call, `<|call|>` (both stop tokens: their text never reaches here). The
recipient may stand before the channel or after it, and `<|constrain|>json` (or a bare `json`) may
follow; all of that is header up to `<|message|>`.

HarmonyReply has ChatReply's interface (push, finish, whole). Streaming holds back only a header
until its `<|message|>` and a body's last characters while they may still begin an end marker; a
tool call streams as OpenAI's do: its id, type and name first, then pieces of its arguments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tpserve.server.chat_reply import partial_suffix
from tpserve.server.tool_calls import ToolMode, tool_call

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
STOP_TOKENS = (RETURN, CALL)  # the two that end a reply (besides the model's other EOS tokens)
BODY_ENDS = (END, RETURN, CALL)
# What a reply (or the text after a message's end) may open a header with.
HEADER_OPENERS = (CHANNEL, START, " to=", "to=", CONSTRAIN)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass(frozen=True)
class _Header:
    channel: str
    recipient: str

    @classmethod
    def read(cls, text: str) -> _Header:
        recipient = _RECIPIENT.search(text)
        channel = _CHANNEL.search(text)
        return cls(channel.group(1) if channel else "", recipient.group(1) if recipient else "")


class HarmonyReply:
    def __init__(self, tools: ToolMode | None, reasoning: bool):
        """`tools`: how calls are read (None: no tools offered, a call's body is reasoning);
        `reasoning`: analysis goes to reasoning_content (False: to content, nothing hidden)."""
        self._tools = tools
        self._reasoning = reasoning
        self._pending = ""  # text not yet read
        self._state = "start"  # start (the reply's first text), header, body, between, plain
        self._target = ""  # where the current body goes: content, reasoning_content, call, drop
        self._num_calls = 0

    def push(self, text: str) -> list[dict]:
        """Delta objects for newly released text (maybe none yet)."""
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> tuple[list[dict], bool]:
        """The deltas still held, and whether the reply made tool calls (finish_reason tool_calls)."""
        return self._drain(final=True), self._num_calls > 0

    def whole(self, text: str) -> tuple[dict, bool]:
        """The assistant message of a whole reply, and whether it made tool calls."""
        deltas = self.push(text)
        more, called = self.finish()
        return merged_message(deltas + more), called

    def _drain(self, *, final: bool) -> list[dict]:
        deltas: list[dict] = []
        while self._pending:
            before = (self._state, len(self._pending))
            getattr(self, "_read_" + self._state)(deltas, final)
            if (self._state, len(self._pending)) == before:
                break  # waiting for more text
        if final:
            self._pending = ""  # an unfinished header says nothing
        return deltas

    def _read_start(self, deltas: list[dict], final: bool) -> None:
        text = self._pending
        if any(text.startswith(opener) for opener in HEADER_OPENERS):
            self._state = "header"
        elif final or not any(opener.startswith(text) for opener in HEADER_OPENERS):
            self._state = "plain"  # not harmony at all: the model wrote bare text

    def _read_plain(self, deltas: list[dict], final: bool) -> None:
        deltas.append({"content": self._pending})
        self._pending = ""

    def _read_header(self, deltas: list[dict], final: bool) -> None:
        at = self._pending.find(MESSAGE)
        if at == -1:
            return
        header = _Header.read(self._pending[:at])
        self._pending = self._pending[at + len(MESSAGE) :]
        self._state = "body"
        self._target = self._target_of(header)
        if self._target == "call":
            name = header.recipient[len(FUNCTIONS) :]
            call = tool_call(name, "")
            deltas.append({"tool_calls": [{"index": self._num_calls, **call}]})
            self._num_calls += 1

    def _read_body(self, deltas: list[dict], final: bool) -> None:
        ends = [(at, marker) for marker in BODY_ENDS if (at := self._pending.find(marker)) != -1]
        if ends:
            at, marker = min(ends)
            self._send(deltas, self._pending[:at])
            self._pending = self._pending[at + len(marker) :]
            self._state = "between"
            return
        keep = 0 if final else max(partial_suffix(self._pending, marker) for marker in BODY_ENDS)
        self._send(deltas, self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]

    def _read_between(self, deltas: list[dict], final: bool) -> None:
        # Between messages only a new header counts (<|start|>role..., or a bare <|channel|>).
        found = [at for opener in (START, CHANNEL) if (at := self._pending.find(opener)) != -1]
        if found:
            self._pending = self._pending[min(found) :]
            self._state = "header"
        else:
            keep = max(partial_suffix(self._pending, opener) for opener in (START, CHANNEL))
            self._pending = self._pending[len(self._pending) - keep :] if keep else ""

    def _target_of(self, header: _Header) -> str:
        if header.recipient.startswith(FUNCTIONS) and self._tools is not None:
            if self._tools.parallel or self._num_calls == 0:
                return "call"
            return "drop"  # parallel_tool_calls false: the first call only
        if header.recipient or (header.channel == "analysis" and self._reasoning):
            return "reasoning_content"  # the model's own tools and its thoughts are not content
        return "content"  # final, and commentary's user-visible preambles

    def _send(self, deltas: list[dict], text: str) -> None:
        if not text or self._target == "drop":
            return
        if self._target == "call":
            piece = {"index": self._num_calls - 1, "function": {"arguments": text}}
            deltas.append({"tool_calls": [piece]})
        else:
            deltas.append({self._target: text})


def merged_message(deltas: list[dict]) -> dict:
    """One assistant message out of a reply's deltas (a call's pieces joined into its arguments)."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", ()):
            if piece["index"] not in calls:
                calls[piece["index"]] = {k: v for k, v in piece.items() if k != "index"}
                calls[piece["index"]]["function"] = dict(piece["function"])
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message

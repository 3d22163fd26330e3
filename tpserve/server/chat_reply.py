"""A chat reply's text split the way OpenAI clients read it: `reasoning_content` (a thinking model's
`<think>...</think>`), `content`, and `tool_calls` (tpserve/server/tool_calls.py), whole or as stream deltas.

Streaming holds back only what may still turn out to be a marker (`</think>`, a tool call's start);
a tool call's arguments arrive whole at the reply's end, in one delta per call, which OpenAI clients
accumulate like any other delta.
"""

from __future__ import annotations

from tpserve.server.tool_calls import MARKERS, ToolMode, marker_start, parse_calls

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# --reasoning-parser: qwen3 splits <think> blocks the reply opens; deepseek_r1 also counts the
# reply's start as inside one (R1 distills' templates open it in the prompt, or the model omits it).
# gpt_oss reads harmony channels instead (tpserve/server/harmony.py).
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")


def thinks(template: str) -> bool:
    """Whether a chat template's model reasons in <think> tags (Qwen3, DeepSeek-R1 distills)."""
    return THINK_OPEN in template


class ChatReply:
    def __init__(self, tools: ToolMode | None, reasoning: bool, starts_thinking: bool):
        """`reasoning`: split out <think> blocks; `starts_thinking`: the prompt already opened one
        (a DeepSeek-R1 template ends its generation prompt with <think>)."""
        self._tools = tools
        self._reasoning = reasoning
        self._thinking = reasoning and starts_thinking
        self._pending = ""  # text not yet sent: a possible marker, or a tool call
        self._calling = False  # a tool call began: everything from here waits for the end
        self._started = False  # any text seen yet (an opening <think> only counts first)
        self._after_think = False  # a </think> just closed: newlines next are dropped

    def push(self, text: str) -> list[dict]:
        """Delta objects for newly released text (maybe none yet)."""
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> tuple[list[dict], bool]:
        """The deltas still held, and whether the reply made tool calls (finish_reason tool_calls)."""
        deltas = self._drain(final=True)
        if not self._calling:
            return deltas, False
        content, calls = parse_calls(self._pending, self._tools)
        self._pending = ""
        if content:
            deltas.append({"content": content})
        for index, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": index, **call}]})
        return deltas, bool(calls)

    def whole(self, text: str) -> tuple[dict, bool]:
        """The assistant message of a whole reply, and whether it made tool calls."""
        deltas = self.push(text)
        more, called = self.finish()
        message: dict = {"role": "assistant", "content": None}
        content = "".join(d.get("content", "") for d in deltas + more)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas + more)
        calls = [d["tool_calls"][0] for d in deltas + more if "tool_calls" in d]
        message["content"] = content if content or not calls else None
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
        return message, called

    def _drain(self, *, final: bool) -> list[dict]:
        deltas: list[dict] = []
        while self._pending and not self._calling:
            if self._reasoning and not self._started and not self._thinking:
                if THINK_OPEN.startswith(self._pending) and not final:
                    break  # may yet be the opening tag
                if self._pending.startswith(THINK_OPEN):
                    self._pending = self._pending[len(THINK_OPEN) :]
                    self._thinking = True
            self._started = True
            if self._thinking:
                at = self._pending.find(THINK_CLOSE)
                if at == -1:
                    keep = 0 if final else partial_suffix(self._pending, THINK_CLOSE)
                    sent, self._pending = (
                        self._pending[: len(self._pending) - keep],
                        self._pending[len(self._pending) - keep :],
                    )
                    if sent:
                        deltas.append({"reasoning_content": sent})
                    break
                if at:
                    deltas.append({"reasoning_content": self._pending[:at]})
                self._pending = self._pending[at + len(THINK_CLOSE) :]
                self._thinking = False
                self._after_think = True
                continue
            if self._after_think:  # the newlines templates put after </think> are not content
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    break
                self._after_think = False
            at = marker_start(self._pending, self._tools) if self._tools is not None else None
            if at is None:
                deltas.append({"content": self._pending})
                self._pending = ""
            else:
                if at:
                    deltas.append({"content": self._pending[:at]})
                self._pending = self._pending[at:]
                if final or not _is_partial(self._pending, self._tools):
                    self._calling = True
                break
        return deltas


def partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _is_partial(text: str, tools: ToolMode) -> bool:
    """The held text is still only a prefix of a marker (it may turn back into content)."""
    return any(marker.startswith(text) and marker != text for marker in MARKERS.get(tools.parser or "", ()))


def prompt_opens_think(tokenizer) -> bool:
    """The template's generation prompt itself opens the <think> block (DeepSeek-R1 distills)."""
    try:
        prompt = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    except Exception:  # noqa: BLE001 (a template that refuses this conversation opens nothing)
        return False
    return prompt.rstrip().endswith(THINK_OPEN)

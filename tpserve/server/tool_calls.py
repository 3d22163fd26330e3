"""Tool calls in a chat reply: which format the model writes them in (its template's family), how a
reply's text becomes OpenAI `tool_calls`, and the grammar that forces a call for tool_choice
`required` or a named function.

Families: `hermes` (Hermes, Qwen2.5/Qwen3: `<tool_call>{"name", "arguments"}</tool_call>` blocks),
`llama3` (a bare `{"name", "parameters"}` object, maybe after `<|python_tag|>`), `mistral`
(`[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`; the marker is a special token the
detokenizer drops, so the list itself is what is read).
With a named function or `required`, the grammar makes the reply a JSON value (the arguments, or a
list of {"name", "arguments"}) whatever the family, as vLLM does, so its arguments always validate.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

PARSERS = ("hermes", "llama3", "mistral", "harmony")  # harmony: gpt-oss, tpserve/server/harmony.py
MARKERS = {
    "hermes": ("<tool_call>",),
    "llama3": ("<|python_tag|>", '{"name"'),
    "mistral": ("[TOOL_CALLS]", '[{"'),
}


def parser_for_template(template: str) -> str | None:
    """The family a chat template's tool calls belong to; None when it offers no tools."""
    if "<|channel|>" in template:
        return "harmony"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return None


@dataclass(frozen=True)
class ToolMode:
    """How one request's reply may call tools."""

    parser: str | None  # the family (PARSERS) for tool_choice auto; None: the template has none
    choice: str  # "auto", "required" or "named"
    function: str = ""  # with "named"
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only


def forcing_schema(tools: list[dict], mode: ToolMode) -> dict | None:
    """The JSON schema the reply must match for `required` or a named function; None for auto."""
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if mode.choice == "named":
        return functions[mode.function].get("parameters") or {"type": "object"}
    if mode.choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def tool_call(name: str, arguments) -> dict:
    """One OpenAI tool call (arguments as JSON text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def parse_calls(text: str, mode: ToolMode) -> tuple[str, list[dict]]:
    """(content left, tool calls) of a whole reply; the text unchanged and no calls when it holds
    none in the family's format (a call that does not parse stays content, as vLLM leaves it)."""
    if mode.choice == "named":
        return "", [tool_call(mode.function, text)]
    if mode.choice == "required":
        calls = _json_or_none(text)
        found = [tool_call(c["name"], c["arguments"]) for c in calls or [] if isinstance(c, dict)]
        return ("", _first(found, mode)) if found else (text, [])
    if mode.parser == "hermes":
        return _hermes(text, mode)
    if mode.parser in ("llama3", "mistral"):
        return _bare_json(text, mode)
    return text, []


def marker_start(text: str, mode: ToolMode) -> int | None:
    """Where in `text` a tool call begins or may begin (a marker, or a prefix of one at the end):
    streamed content stops there and the rest waits for the reply's end. None: all of it is content."""
    if mode.choice in ("named", "required"):
        return 0
    markers = MARKERS.get(mode.parser or "", ())
    found = [text.find(marker) for marker in markers if marker in text]
    if mode.parser in ("llama3", "mistral"):
        # A bare JSON call is the whole reply: only a reply that starts with it counts.
        stripped = len(text) - len(text.lstrip())
        found = [at for at in found if at == stripped] + [
            stripped for marker in markers if marker.startswith(text[stripped:]) and text[stripped:]
        ]
    else:
        for marker in markers:
            for size in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:size]):
                    found.append(len(text) - size)
                    break
    return min(found) if found else None


def _hermes(text: str, mode: ToolMode) -> tuple[str, list[dict]]:
    calls, content, at = [], [], 0
    while (start := text.find("<tool_call>", at)) != -1:
        end = text.find("</tool_call>", start)
        body = text[start + len("<tool_call>") : end if end != -1 else len(text)]
        call = _json_or_none(body.strip())
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            break
        content.append(text[at:start])
        calls.append(tool_call(call["name"], call.get("arguments", {})))
        at = len(text) if end == -1 else end + len("</tool_call>")
    if not calls:
        return text, []
    content.append(text[at:])
    return "".join(content).strip(), _first(calls, mode)


def _bare_json(text: str, mode: ToolMode) -> tuple[str, list[dict]]:
    value = _json_or_none(text.strip().removeprefix("<|python_tag|>").removeprefix("[TOOL_CALLS]").strip())
    items = value if isinstance(value, list) else [value]
    calls = [
        tool_call(item["name"], item.get("arguments", item.get("parameters", {})))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]
    return ("", _first(calls, mode)) if calls and len(calls) == len(items) else (text, [])


def _first(calls: list[dict], mode: ToolMode) -> list[dict]:
    return calls if mode.parallel else calls[:1]


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None

"""What a chat request to a harmony model (gpt-oss) asks beyond the others: its reply's special
tokens kept in the text (they are the structure tpserve/server/harmony.py reads), `<|return|>` and `<|call|>`
as stop tokens, and for tool_choice `required` or a named function a grammar that makes the reply
one harmony tool call, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`,
its arguments valid against the function's schema (llguidance's Lark: `<|name|>` is that special
token, `%json` a JSON schema). And OpenAI's `reasoning_effort`, which gpt-oss's template reads (its system
message's `Reasoning:` line), as vLLM honours it for gpt-oss."""

from __future__ import annotations

import json

from tpserve.server.grammar import JSON_OPTIONS
from tpserve.server.harmony import CHANNEL, CONSTRAIN, FUNCTIONS, MESSAGE, STOP_TOKENS
from tpserve.server.openai_fields import FieldRefused
from tpserve.server.tool_calls import ToolMode

EFFORTS = ("low", "medium", "high")


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids of the harmony stop tokens this vocabulary holds as single tokens."""
    ids = [tokenizer.encode(marker, add_bos=False) for marker in STOP_TOKENS]
    return tuple(one[0] for one in ids if len(one) == 1)


def prepare(request, harmony_stop_ids: tuple[int, ...]) -> None:
    """A GenerateRequest made ready for a harmony reply: special tokens kept, stop tokens added."""
    request.keep_special_tokens = True
    request.stop_token_ids.extend(i for i in harmony_stop_ids if i not in request.stop_token_ids)


def with_effort(body: dict) -> dict:
    """The body with its reasoning_effort moved into chat_template_kwargs (unless those set one)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return body
    if effort not in EFFORTS:
        raise FieldRefused("reasoning_effort", "reasoning_effort must be low, medium or high")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return body  # refused by name where chat_template_kwargs are read
    rest = {name: value for name, value in body.items() if name != "reasoning_effort"}
    return {**rest, "chat_template_kwargs": {"reasoning_effort": effort, **(kwargs or {})}}


def forcing_grammar(tools: list[dict], mode: ToolMode) -> str | None:
    """The Lark grammar of one harmony call to the named function or (required) any of `tools`;
    None for auto."""
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if mode.choice == "named":
        names = [mode.function]
    elif mode.choice == "required":
        names = list(functions)
    else:
        return None
    alternatives = " | ".join(f"call_{i}" for i in range(len(names)))
    rules = [f'start: {CHANNEL} "commentary to={FUNCTIONS}" ({alternatives})']
    for i, name in enumerate(names):
        schema = functions[name].get("parameters") or {"type": "object"}
        schema = {**schema, "x-guidance": JSON_OPTIONS}  # JSON as the other families' forcing writes it
        rules.append(f'call_{i}: {json.dumps(name)} " " {CONSTRAIN} "json" {MESSAGE} arguments_{i}')
        rules.append(f"arguments_{i}: %json {json.dumps(schema)}")
    return "\n".join(rules)

"""What a chat request hands its template besides roles and text: the tools on offer, each turn's
tool calls and tool results, and extra template variables (chat_template_kwargs), read from the
GenerateRequest's JSON fields as transformers' apply_chat_template receives them."""

from __future__ import annotations

import contextlib
import json

from tpserve.server.validation import invalid_argument

# Variables the server itself sets; chat_template_kwargs may not replace them.
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "unk_token", "pad_token")


def template_inputs(request) -> dict:
    """tools, template_kwargs (None where the request sets none), add_generation_prompt and
    continue_final_message for Tokenizer.encode_chat, from a GenerateRequest or TokenizeRequest."""
    generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    if request.continue_final_message and generation_prompt:
        raise invalid_argument(
            "continue_final_message needs add_generation_prompt: false (the reply continues the last message)"
        )
    tools = _json(request.tools_json, "tools", list) if request.tools_json else None
    kwargs = None
    if request.chat_template_kwargs_json:
        kwargs = _json(request.chat_template_kwargs_json, "chat_template_kwargs", dict)
        reserved = sorted(set(kwargs) & set(RESERVED))
        if reserved:
            raise invalid_argument(f"chat_template_kwargs may not set {', '.join(reserved)}")
    return {
        "tools": tools,
        "template_kwargs": kwargs,
        "add_generation_prompt": generation_prompt,
        "continue_final_message": request.continue_final_message,
    }


def tool_fields(message) -> dict:
    """A ChatMessage's tool_calls, tool_call_id and name, for the template (only those it sets)."""
    fields: dict = {}
    if message.tool_calls_json:
        calls = _json(message.tool_calls_json, "tool_calls", list)
        for call in calls:
            # OpenAI sends arguments as JSON text; templates (Qwen's, Llama's, Hermes') write them
            # with tojson or test for a mapping, so they get the object, as vLLM hands them over.
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                with contextlib.suppress(json.JSONDecodeError):
                    function["arguments"] = json.loads(function["arguments"])
        fields["tool_calls"] = calls
    if message.tool_call_id:
        fields["tool_call_id"] = message.tool_call_id
    if message.name:
        fields["name"] = message.name
    return fields


def _json(text: str, name: str, kind: type):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise invalid_argument(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, kind):
        raise invalid_argument(f"{name} must be {'a list' if kind is list else 'an object'}")
    return value

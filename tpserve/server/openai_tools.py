"""The tool fields of an OpenAI chat body -> the GenerateRequest's tools and constraint, and the
ToolMode the reply is read with (tpserve/server/tool_calls.py); plus each message's tool calls and tool
results, and chat_template_kwargs, which go to the chat template."""

from __future__ import annotations

import json

from tpserve.server.harmony_requests import forcing_grammar
from tpserve.server.openai_fields import FieldRefused
from tpserve.server.tool_calls import ToolMode, forcing_schema
from tpserve.v1 import serving_pb2


def add_tools(body: dict, request: serving_pb2.GenerateRequest, parser: str | None) -> ToolMode | None:
    """Reads tools, tool_choice, parallel_tool_calls and chat_template_kwargs into `request`; the
    reply's ToolMode, or None when the reply is plain text. `parser`: the model's tool-call family."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise FieldRefused("chat_template_kwargs", "chat_template_kwargs must be an object")
        request.chat_template_kwargs_json = json.dumps(kwargs)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise FieldRefused("tool_choice", "tool_choice needs tools")
        return None
    _check_tools(tools)
    mode = _mode(choice, tools, parser, body.get("parallel_tool_calls"))
    if mode is None:
        return None  # tool_choice none: the model is not offered the tools
    request.tools_json = json.dumps(tools)
    if parser == "harmony":  # the forced reply is a harmony call, not bare JSON
        grammar = forcing_grammar(tools, mode)
        forcing = None if grammar is None else serving_pb2.Constraint(grammar=grammar)
    else:
        schema = forcing_schema(tools, mode)
        forcing = None if schema is None else serving_pb2.Constraint(json_schema=json.dumps(schema))
    if forcing is not None:
        if request.HasField("constraint"):
            raise FieldRefused(
                "tool_choice", f"tool_choice {choice!r} and a response format both constrain the reply"
            )
        request.constraint.CopyFrom(forcing)
    return mode


def add_message_tools(added: serving_pb2.ChatMessage, message: dict, where: str) -> None:
    """An assistant message's tool_calls, a tool message's tool_call_id and name."""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
            raise FieldRefused(f"{where}.tool_calls", f"{where}.tool_calls must be a list of tool calls")
        added.tool_calls_json = json.dumps(calls)
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise FieldRefused(f"{where}.{key}", f"{where}.{key} must be a string")
            setattr(added, key, value)


def _check_tools(tools) -> None:
    if not isinstance(tools, list):
        raise FieldRefused("tools", "tools must be a list")
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise FieldRefused(
                where, f"{where} must be a function tool ({{'type': 'function', 'function': ...}})"
            )
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FieldRefused(f"{where}.function", f"{where}.function must be an object with a name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise FieldRefused(
                f"{where}.function.parameters", f"{where}.function.parameters must be an object"
            )


def _mode(choice, tools: list[dict], parser: str | None, parallel) -> ToolMode | None:
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldRefused("parallel_tool_calls", "parallel_tool_calls must be true or false")
    parallel = parallel is not False
    if choice in (None, "auto"):
        return ToolMode(parser, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolMode(parser, "required", parallel=parallel)
    name = None
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        name = (choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise FieldRefused(
            "tool_choice",
            "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        )
    if name not in {tool["function"]["name"] for tool in tools}:
        raise FieldRefused("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return ToolMode(parser, "named", function=name, parallel=parallel)

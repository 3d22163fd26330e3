"""A chat reply's text read the way OpenAI clients read it: <think> reasoning, content and tool
calls, whole and streamed in pieces cut anywhere (the pieces must add up to the whole reading)."""

from __future__ import annotations

import json

import pytest

from tpserve.server.chat_reply import ChatReply
from tpserve.server.tool_calls import ToolMode, parse_calls, parser_for_template

HERMES = ToolMode("hermes", "auto")


def streamed(reply: ChatReply, text: str, piece: int) -> tuple[dict, bool]:
    """Pushes `text` in pieces of `piece` characters; the deltas joined, and whether it called."""
    deltas = []
    for at in range(0, len(text), piece):
        deltas += reply.push(text[at : at + piece])
    more, called = reply.finish()
    deltas += more
    joined = {
        "content": "".join(d.get("content", "") for d in deltas),
        "reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas),
        "calls": [
            (d["tool_calls"][0]["function"]["name"], json.loads(d["tool_calls"][0]["function"]["arguments"]))
            for d in deltas
            if "tool_calls" in d
        ],
    }
    return joined, called


CASES = [
    # (tools, reasoning, starts_thinking, text, content, reasoning_content, calls)
    (None, True, False, "<think>let me see</think>\n\nIt is 4.", "It is 4.", "let me see", []),
    (None, True, True, "hmm, two and two</think>4", "4", "hmm, two and two", []),
    (
        None,
        True,
        False,
        "No thinking here, <think> is just text.",
        "No thinking here, <think> is just text.",
        "",
        [],
    ),
    (None, True, False, "<think>cut off before the end", "", "cut off before the end", []),
    (
        HERMES,
        False,
        False,
        'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        "Sure. ",
        "",
        [("f", {"x": 1})],
    ),
    (
        HERMES,
        True,
        False,
        '<think>call f twice</think><tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"a": "b"}}</tool_call>',
        "",
        "call f twice",
        [("f", {}), ("g", {"a": "b"})],
    ),
    (HERMES, False, False, "a < b and <tool_ca is no call", "a < b and <tool_ca is no call", "", []),
    (HERMES, False, False, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", "", []),
]


@pytest.mark.parametrize("tools, reasoning, starts, text, content, thought, calls", CASES)
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_pieces_add_up_to_the_whole_reading(tools, reasoning, starts, text, content, thought, calls, piece):
    message, called = ChatReply(tools, reasoning, starts).whole(text)
    assert (message["content"] or "") == content
    assert message.get("reasoning_content", "") == thought
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
    ] == calls
    assert called == bool(calls)
    joined, called = streamed(ChatReply(tools, reasoning, starts), text, piece)
    assert (joined["content"], joined["reasoning_content"], joined["calls"], called) == (
        content,
        thought,
        calls,
        bool(calls),
    )


def test_each_family_is_read_from_its_template_and_parsed():
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|python_tag|>") == "llama3"
    assert parser_for_template("{{ messages }}") is None
    llama = parse_calls('{"name": "f", "parameters": {"x": 2}}', ToolMode("llama3", "auto"))
    mistral = parse_calls(
        '[{"name": "f", "arguments": {"x": 2}}, {"name": "g", "arguments": {}}]', ToolMode("mistral", "auto")
    )
    assert [c["function"]["name"] for c in llama[1]] == ["f"] and json.loads(
        llama[1][0]["function"]["arguments"]
    ) == {"x": 2}
    assert [c["function"]["name"] for c in mistral[1]] == ["f", "g"]
    assert parse_calls("just text", ToolMode("llama3", "auto")) == ("just text", [])
    single = parse_calls(
        '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
        ToolMode(None, "required", parallel=False),
    )
    assert [c["function"]["name"] for c in single[1]] == ["f"]  # parallel_tool_calls: false

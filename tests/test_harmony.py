"""The harmony reader (tpserve/server/harmony.py) on reply texts as gpt-oss writes them, fed whole and one
character at a time (a stream may split a reply anywhere): channels to reasoning_content and content,
calls to tool_calls, and the forcing grammar for tool_choice required or named (llguidance accepts
a harmony call and refuses bare JSON)."""

from __future__ import annotations

import json

import llguidance
import pytest
from harmony_models import build_harmony_tokenizer

from tpserve.server.chat_parsing import ChatParsing
from tpserve.server.harmony import HarmonyReply, merged_message
from tpserve.server.harmony_requests import forcing_grammar
from tpserve.server.tool_calls import ToolMode

AUTO = ToolMode("harmony", "auto")
THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4."
)
CALL_AFTER_THOUGHT = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def streamed(text: str, tools: ToolMode | None = AUTO, reasoning: bool = True) -> tuple[list[dict], bool]:
    reply = HarmonyReply(tools, reasoning)
    deltas = [delta for char in text for delta in reply.push(char)]
    more, called = reply.finish()
    return deltas + more, called


def test_analysis_is_reasoning_and_final_is_content_whole_and_streamed():
    message, called = HarmonyReply(AUTO, True).whole(THINK_THEN_ANSWER)
    assert (message["content"], message["reasoning_content"], called) == (
        "It is 4.",
        "User asks 2+2. Easy.",
        False,
    )
    deltas, _ = streamed(THINK_THEN_ANSWER)
    assert merged_message(deltas) == message
    assert all("<|" not in text for delta in deltas for text in delta.values())  # no marker leaks


def test_a_call_becomes_tool_calls_streamed_name_first_then_arguments():
    message, called = HarmonyReply(AUTO, True).whole(CALL_AFTER_THOUGHT)
    (call,) = message["tool_calls"]
    assert called and message["content"] is None and message["reasoning_content"] == "Need the weather."
    assert (call["type"], call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "function",
        "get_weather",
        {"city": "Rome"},
    )
    deltas, called = streamed(CALL_AFTER_THOUGHT)
    pieces = [piece for delta in deltas for piece in delta.get("tool_calls", ())]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""} and pieces[0]["id"].startswith(
        "call_"
    )
    assert len(pieces) > 2 and all(set(piece) == {"index", "function"} for piece in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Rome"}' and called


def test_a_recipient_before_the_channel_is_read_too():
    text = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
    message, called = HarmonyReply(AUTO, True).whole(text[len("<|start|>assistant") :])
    assert called and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_final_only_plain_text_and_preambles_are_content():
    assert HarmonyReply(None, True).whole("<|channel|>final<|message|>Hi there.")[0] == {
        "role": "assistant",
        "content": "Hi there.",
    }
    assert HarmonyReply(None, True).whole("no harmony at all")[0]["content"] == "no harmony at all"
    preamble = (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    )
    assert HarmonyReply(AUTO, True).whole(preamble)[0]["content"] == "Checking.Done."


def test_a_reply_cut_mid_analysis_has_its_reasoning_and_no_content():
    message, called = HarmonyReply(AUTO, True).whole("<|channel|>analysis<|message|>Let me think about")
    assert (message["content"], message["reasoning_content"], called) == ("", "Let me think about", False)
    assert streamed("<|channel|>analysis<|message|>Let me think about")[0][-1] == {"reasoning_content": "t"}


def test_without_tools_or_reasoning_nothing_is_hidden_and_nothing_is_called():
    message, called = HarmonyReply(None, False).whole(THINK_THEN_ANSWER)
    assert (message, called) == ({"role": "assistant", "content": "User asks 2+2. Easy.It is 4."}, False)
    message, called = HarmonyReply(None, True).whole(CALL_AFTER_THOUGHT)
    assert not called and message["reasoning_content"] == 'Need the weather.{"city": "Rome"}'


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = CALL_AFTER_THOUGHT + "<|end|><|start|>assistant<|channel|>commentary to=functions.noop<|message|>{}"
    assert len(HarmonyReply(AUTO, True).whole(two)[0]["tool_calls"]) == 2
    assert (
        len(HarmonyReply(ToolMode("harmony", "auto", parallel=False), True).whole(two)[0]["tool_calls"]) == 1
    )


@pytest.mark.parametrize(
    "mode", [ToolMode("harmony", "required"), ToolMode("harmony", "named", "get_weather")]
)
def test_the_forcing_grammar_is_one_harmony_call(mode):
    tools = [WEATHER, {"type": "function", "function": {"name": "noop"}}]
    grammar = llguidance.LLMatcher.grammar_from_lark(forcing_grammar(tools, mode))
    tokenizer = llguidance.LLTokenizer(_harmony_tokenizer_json(), n_vocab=320, eos_token=[0])
    good = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
    assert _accepts(tokenizer, grammar, good)
    assert not _accepts(tokenizer, grammar, '{"city": "Rome"}')
    assert not _accepts(tokenizer, grammar, good.replace('"Rome"', "3"))
    assert forcing_grammar(tools, AUTO) is None


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    ids = tokenizer.tokenize_str(text)
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def _harmony_tokenizer_json() -> str:
    return build_harmony_tokenizer().to_str()


class _Template:
    """What ChatParsing reads of a tokenizer: its template, and the ids of the stop tokens."""

    def __init__(self, template: str):
        self.chat_template = template

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return {"<|return|>": [2], "<|call|>": [9]}.get(text, [5, 6])

    def render_chat(self, messages) -> str:
        return ""


@pytest.mark.parametrize(
    "template, tool_flag, reasoning_flag, harmony",
    [
        ("<|start|>assistant<|channel|>final<|message|>", "", "", True),  # gpt-oss's own template
        ("<|im_start|>assistant\n", "", "gpt_oss", True),
        ("<|im_start|>assistant\n", "harmony", "", True),
        ("<|start|>assistant<|channel|>final<|message|>", "", "qwen3", False),  # the flag decides
        ("<|im_start|>assistant\n<tool_call>", "", "", False),
    ],
)
def test_harmony_is_chosen_from_the_template_or_the_flags(template, tool_flag, reasoning_flag, harmony):
    parsing = ChatParsing(_Template(template), tool_flag, reasoning_flag)
    assert parsing.harmony == harmony
    parsed = parsing.parse_chat({"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [9]})
    (request,) = parsed.choices
    if harmony:  # special tokens kept for the reader; <|return|> and <|call|> end the reply, once each
        assert request.keep_special_tokens and list(request.stop_token_ids) == [9, 2]
        assert isinstance(parsing.replies(parsed, 1)[0], HarmonyReply)
    else:
        assert not request.keep_special_tokens and list(request.stop_token_ids) == [9]

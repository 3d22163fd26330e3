"""Harmony over HTTP against the real two-rank daemon, on a tiny gpt-oss with gpt-oss's own chat
template and a tokenizer holding the harmony special tokens (tests/harmony_models.py). The random
model would never write harmony; a Lark grammar (whose `<|name|>` is that special token) makes it
write a given reply, and the server reads what the client sees: reasoning_content and content, tool
calls, finish reasons, whole and streamed; tool_choice required/named are forced as harmony calls."""

from __future__ import annotations

import json

import openai
import pytest
from daemon import running_daemon
from harmony_models import write_harmony_model

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,  # a random model's forced arguments stay short
        },
    },
}
THINK_THEN_ANSWER = (
    'start: <|channel|> "analysis" <|message|> "two and two" <|end|>'
    ' <|start|> "assistant" <|channel|> "final" <|message|> "It is 4."'
)
CALL = (
    'start: <|channel|> "analysis" <|message|> "need weather" <|end|> <|start|> "assistant"'
    ' <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\": \\"Rome\\"}"'
)


def forced(grammar: str) -> dict:
    return {"structured_outputs": {"grammar": grammar}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_harmony_model(tmp_path_factory.mktemp("harmony-model"))
    log_dir = tmp_path_factory.mktemp("harmony-logs")
    with (
        running_daemon("spawn", model_dir, log_dir, "--context", "1024", "--lanes", "2") as daemon,
        openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as client,
    ):
        client.served_model = client.models.list().data[0].id
        yield client, model_dir


def chat(client, **fields):
    fields = {"max_tokens": 60, "messages": MESSAGES} | fields
    return client.chat.completions.create(model=client.served_model, **fields)


def streamed(client, **fields) -> tuple[str, str, dict, list]:
    content, reasoning, calls, reasons = "", "", {}, []
    for chunk in chat(client, stream=True, **fields):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or piece.id
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    return content, reasoning, calls, reasons


def test_analysis_is_reasoning_content_and_final_is_content_whole_and_streamed(served):
    client, _ = served
    choice = chat(client, extra_body=forced(THINK_THEN_ANSWER)).choices[0]
    assert (choice.message.content, choice.message.model_extra["reasoning_content"]) == (
        "It is 4.",
        "two and two",
    )
    assert choice.finish_reason == "stop"
    content, reasoning, calls, reasons = streamed(client, extra_body=forced(THINK_THEN_ANSWER))
    assert (content, reasoning, calls, reasons[-1]) == ("It is 4.", "two and two", {}, "stop")


def test_a_final_only_reply_is_plain_content(served):
    client, _ = served
    message = (
        chat(client, extra_body=forced('start: <|channel|> "final" <|message|> "Hello."')).choices[0].message
    )
    assert (message.content, message.model_extra.get("reasoning_content"), message.tool_calls) == (
        "Hello.",
        None,
        None,
    )


def test_a_reply_cut_mid_analysis_keeps_its_reasoning(served):
    client, _ = served
    long_thought = forced(
        'start: <|channel|> "analysis" <|message|> "the quick brown fox jumps over the lazy dog"'
    )
    # 10 tokens of header (byte-level: "analysis" is 8), then a few of the thought
    choice = chat(client, max_tokens=14, extra_body=long_thought).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert "the quick brown fox jumps over the lazy dog".startswith(
        choice.message.model_extra["reasoning_content"]
    )
    assert choice.message.model_extra["reasoning_content"]
    content, reasoning, _, reasons = streamed(client, max_tokens=14, extra_body=long_thought)
    assert (content, reasoning, reasons[-1]) == (
        "",
        choice.message.model_extra["reasoning_content"],
        "length",
    )


def test_a_harmony_call_is_tool_calls_whole_and_streamed(served):
    client, _ = served
    choice = chat(client, tools=[WEATHER], max_tokens=200, extra_body=forced(CALL)).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "need weather"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Rome"},
    )
    content, reasoning, calls, reasons = streamed(
        client, tools=[WEATHER], max_tokens=200, extra_body=forced(CALL)
    )
    assert (content, reasoning, reasons[-1]) == ("", "need weather", "tool_calls")
    (entry,) = calls.values()
    assert entry["id"].startswith("call_") and (entry["name"], json.loads(entry["arguments"])) == (
        "get_weather",
        {"city": "Rome"},
    )


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_tool_choice_force_a_valid_harmony_call(served, tool_choice):
    client, _ = served
    # (gpt-oss's template needs a description on every tool)
    noop = {
        "type": "function",
        "function": {
            "name": "noop",
            "description": "nothing",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    choice = chat(client, tools=[WEATHER, noop], tool_choice=tool_choice, max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "noop") and isinstance(arguments, dict)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Rome")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"


def test_tool_turns_render_as_transformers_renders_them(served):
    client, model_dir = served
    turns = MESSAGES + [
        {
            "role": "assistant",
            "content": None,  # OpenAI's form of a turn that only calls
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = chat(client, messages=turns, tools=[WEATHER], max_tokens=1, extra_body={"return_token_ids": True})
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    # transformers takes a call's arguments as an object (its docs' form; vLLM hands them over so)
    hf_turns = json.loads(json.dumps(turns))
    hf_turns[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    hf_turns[1]["content"] = ""  # gpt-oss's template tests `in message.content`: text, never null
    expected = tokenizer.apply_chat_template(
        hf_turns, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary" in expected
    assert tokenizer.decode(reply.model_extra["prompt_token_ids"]) == expected


def test_reasoning_effort_reaches_gpt_oss_template(served):
    client, model_dir = served
    for effort in ("low", "high"):
        reply = chat(client, max_tokens=1, reasoning_effort=effort, extra_body={"return_token_ids": True})
        prompt = transformers.AutoTokenizer.from_pretrained(model_dir).decode(
            reply.model_extra["prompt_token_ids"]
        )
        assert f"Reasoning: {effort}\n" in prompt
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, reasoning_effort="extreme")
    assert raised.value.body["param"] == "reasoning_effort"


def test_a_front_process_reads_harmony_too(tmp_path):
    # The front makes the text from the engine's raw tokens: it too must keep the special tokens.
    model_dir = write_harmony_model(tmp_path / "model")
    args = ("--context", "1024", "--lanes", "2", "--front-process", "true")
    with (
        running_daemon("spawn", model_dir, tmp_path / "logs", *args) as daemon,
        openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as client,
    ):
        assert daemon.front() is not None
        client.served_model = client.models.list().data[0].id
        content, reasoning, calls, reasons = streamed(client, extra_body=forced(THINK_THEN_ANSWER))
        assert (content, reasoning, calls, reasons[-1]) == ("It is 4.", "two and two", {}, "stop")

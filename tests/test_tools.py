"""Tools against the real two-rank daemon over loopback, on a tiny model with a Hermes-style chat
template (`<tool_call>` JSON blocks, as Qwen's): a named tool choice and `required` return calls whose
arguments validate, `auto` parses calls whole and streamed, and the tools and tool turns reach the
template."""

from __future__ import annotations

import json

import openai
import pytest
from daemon import running_daemon, write_daemon_model

CONTEXT = 1024
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls', []) %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("tools-model"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    log_dir = tmp_path_factory.mktemp("tools-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", str(CONTEXT), "--lanes", "4") as served:
        yield served


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        client.served_model = client.models.list().data[0].id
        yield client


def chat(client, **fields):
    fields = {"max_tokens": 120, "messages": MESSAGES, "tools": [WEATHER, TIME]} | fields
    return client.chat.completions.create(model=client.served_model, **fields)


def valid_weather(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome") and 1 <= value["days"] <= 7


def test_a_named_tool_choice_returns_a_call_whose_arguments_validate(client):
    for seed in range(3):
        reply = chat(
            client,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert valid_weather(call.function.arguments)


def test_required_returns_at_least_one_valid_call(client):
    reply = chat(client, tool_choice="required", temperature=1.0, seed=4, max_tokens=300)
    calls = reply.choices[0].message.tool_calls
    assert calls and all(call.function.name in ("get_weather", "get_time") for call in calls)
    for call in calls:
        if call.function.name == "get_weather":
            assert valid_weather(call.function.arguments)
        else:
            assert json.loads(call.function.arguments) == {}


def test_auto_parses_a_call_whole_and_streamed(client):
    # The random model would never write a call; a regex makes it write one, and auto reads it.
    forced = {"structured_outputs": {"regex": _regex_escape("Let me check. " + CALL_TEXT)}}
    whole = chat(client, tool_choice="auto", extra_body=forced)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "Let me check."  # the text before the call, as vLLM's
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Rome", "days": 3},
    )

    content, calls, reasons = "", {}, []
    for chunk in chat(client, tool_choice="auto", extra_body=forced, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Rome", "days": 3})
    ]
    assert reasons[-1] == "tool_calls"


def test_tools_and_tool_turns_reach_the_template(client):
    plain = client.chat.completions.create(model=client.served_model, messages=MESSAGES, max_tokens=1)
    offered = chat(client, max_tokens=1, tool_choice="auto")
    declined = chat(client, max_tokens=1, tool_choice="none")
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens == declined.usage.prompt_tokens
    turns = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    after = chat(client, messages=turns, max_tokens=1)
    tool_part = (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n"
    )
    # Byte-level vocabulary: one token per character, and one per role marker.
    num_tokens = len(tool_part.replace("<|im_start|>", "S").replace("<|im_end|>", "E"))
    assert after.usage.prompt_tokens - offered.usage.prompt_tokens == num_tokens


def test_a_named_function_that_is_not_a_tool_is_refused(client):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert raised.value.body["param"] == "tool_choice"
    assert "'nope', which is not among the tools" in raised.value.body["message"]


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else ("\\n" if c == "\n" else c) for c in text)

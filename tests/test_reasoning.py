"""Reasoning against the real two-rank daemon over loopback, on a tiny model with a Qwen3-style
template: a reply's <think> block arrives as reasoning_content, whole and streamed, and
chat_template_kwargs (enable_thinking) reach the template; include_reasoning: false drops the thought."""

from __future__ import annotations

import json

import openai
import pytest
from daemon import running_daemon, write_daemon_model

QWEN3_STYLE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
# The random model would think forever; a regex makes it write one short thought and an answer.
FORCED = {"structured_outputs": {"regex": r"<think>two and two</think>\n\nIt is 4\."}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("reasoning-model"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_STYLE}))
    log_dir = tmp_path_factory.mktemp("reasoning-logs")
    with (
        running_daemon("spawn", model_dir, log_dir, "--context", "512", "--lanes", "2") as daemon,
        openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as client,
    ):
        client.served_model = client.models.list().data[0].id
        yield client


def chat(client, **fields):
    fields = {"max_tokens": 80, "messages": MESSAGES} | fields
    return client.chat.completions.create(model=client.served_model, **fields)


def test_the_think_block_is_reasoning_content_whole_and_streamed(client):
    message = chat(client, extra_body=FORCED).choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("It is 4.", "two and two")
    content, reasoning = "", ""
    for chunk in chat(client, extra_body=FORCED, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert (content, reasoning) == ("It is 4.", "two and two")


def test_chat_template_kwargs_reach_the_template(client):
    thinking = chat(client, max_tokens=1)
    not_thinking = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not_thinking.usage.prompt_tokens - thinking.usage.prompt_tokens == len("<think>\n\n</think>\n\n")


def test_chat_template_kwargs_may_not_replace_the_servers_own(client):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, extra_body={"chat_template_kwargs": {"messages": []}})
    assert raised.value.body["message"] == "chat_template_kwargs may not set messages"


def test_include_reasoning_false_drops_the_thought_and_keeps_the_answer_whole_and_streamed(client):
    fields = {**FORCED, "include_reasoning": False}
    message = chat(client, extra_body=fields).choices[0].message
    assert message.content == "It is 4." and "reasoning_content" not in (message.model_extra or {})
    pieces = [
        chunk.choices[0].delta for chunk in chat(client, extra_body=fields, stream=True) if chunk.choices
    ]
    assert "".join(delta.content or "" for delta in pieces) == "It is 4."
    assert not any((delta.model_extra or {}).get("reasoning_content") for delta in pieces)

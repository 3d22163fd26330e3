"""How a chat becomes its prompt, with vLLM's fields, against the real daemon (two ranks, a tiny random
model whose template is tests/tiny_models.py's CHAT_TEMPLATE) on loopback:

- add_generation_prompt and continue_final_message, over HTTP, /tokenize and gRPC alike;
- vLLM's chat echo (the last message's text leads the reply where the reply continues it);
- return_token_ids' prompt_token_ids beside a chat's choices; /tokenize's vLLM fields, /tokenizer_info
  and SageMaker's /invocations.
"""

from __future__ import annotations

import httpx
import pytest
from daemon import read_reply, running_daemon, write_daemon_model
from test_http_api import post
from tiny_models import CHAT_TEMPLATE
from transformers import AutoTokenizer

from tpserve.v1 import serving_pb2

CONTEXT = 256
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
OPEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is"
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
REPLY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("chat-prompt-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("chat-prompt-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", str(CONTEXT), "--lanes", "4") as served:
        yield served


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_continue_final_message_continues_the_last_messages_text(daemon):
    chat = ok(post(daemon, "chat/completions", {"messages": MESSAGES, **CONTINUE, **REPLY}))
    plain = ok(post(daemon, "completions", {"prompt": OPEN_PROMPT, **REPLY}))["choices"][0]
    assert chat["prompt_token_ids"] == plain["prompt_token_ids"]  # the turn left open: no <|im_end|>
    assert chat["choices"][0]["token_ids"] == plain["token_ids"]
    assert chat["usage"]["prompt_tokens"] == len(plain["prompt_token_ids"])
    tokenized = ok(post(daemon, "../tokenize", {"messages": MESSAGES, **CONTINUE}))
    assert tokenized["tokens"] == plain["prompt_token_ids"]
    grpc_messages = [serving_pb2.ChatMessage(**m) for m in MESSAGES]
    request = serving_pb2.GenerateRequest(
        messages=grpc_messages,
        max_tokens=6,
        ignore_eos=True,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert read_reply(daemon.stub.Generate(request, timeout=60)).token_ids == plain["token_ids"]

    # vLLM's default add_generation_prompt (true) contradicts it: refused, naming the field.
    refused = post(
        daemon, "chat/completions", {"messages": MESSAGES, "continue_final_message": True, **REPLY}
    )
    assert refused.status_code == 400 and "continue_final_message" in refused.json()["error"]["message"]


def test_add_generation_prompt_false_ends_the_prompt_with_the_last_message(daemon):
    closed = ok(post(daemon, "completions", {"prompt": "<|im_start|>user\nhi<|im_end|>\n", **REPLY}))
    messages = MESSAGES[:1]
    tokenized = ok(post(daemon, "../tokenize", {"messages": messages, "add_generation_prompt": False}))
    assert tokenized["tokens"] == closed["choices"][0]["prompt_token_ids"]
    chat = ok(
        post(daemon, "chat/completions", {"messages": messages, "add_generation_prompt": False, **REPLY})
    )
    assert chat["prompt_token_ids"] == tokenized["tokens"]
    with_header = ok(post(daemon, "chat/completions", {"messages": messages, **REPLY}))
    assert len(with_header["prompt_token_ids"]) > len(tokenized["tokens"])  # "<|im_start|>assistant\n"


def test_chat_echo_leads_with_the_message_the_reply_continues(daemon):
    body = {"messages": MESSAGES, **CONTINUE, **REPLY}
    reply = ok(post(daemon, "chat/completions", body))["choices"][0]["message"]["content"]
    echoed = ok(post(daemon, "chat/completions", {**body, "echo": True}))["choices"][0]["message"]["content"]
    assert echoed == "The answer is" + reply
    # A reply to a user's message continues no message: nothing to echo.
    asked = {"messages": MESSAGES[:1], **REPLY}
    assert (
        ok(post(daemon, "chat/completions", {**asked, "echo": True}))["choices"][0]["message"]["content"]
        == (ok(post(daemon, "chat/completions", asked))["choices"][0]["message"]["content"])
    )
    with httpx.stream(
        "POST", f"{daemon.http_url}/chat/completions", json={**body, "echo": True, "stream": True}, timeout=60
    ) as response:
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert '"role":"assistant"' in chunks[0] and '"content":"The answer is"' in chunks[1]


def test_tokenize_answers_vllms_fields_and_tokenizer_info_describes_the_tokenizer(daemon, model_dir):
    reference = AutoTokenizer.from_pretrained(model_dir)
    text = "This is a token_strs test! vllm1"
    strs = ok(post(daemon, "../tokenize", {"prompt": text, "return_token_strs": True}))
    assert strs["token_strs"] == reference.convert_ids_to_tokens(
        strs["tokens"]
    )  # as the vocabulary spells them
    unspecial = ok(post(daemon, "../tokenize", {"prompt": text, "add_special_tokens": False}))
    assert unspecial["tokens"] == reference.encode(text, add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert ok(post(daemon, "../tokenize", {"messages": MESSAGES[:1], "tools": tools}))["count"] > 0
    for bad, named in (
        ({"tools": "get_weather"}, "tools"),
        ({"continue_final_message": "yes"}, "continue_final_message"),
    ):
        refused = post(daemon, "../tokenize", {"messages": MESSAGES[:1], **bad})
        assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text

    info = httpx.get(f"{daemon.http_url}/../tokenizer_info", timeout=30).json()
    assert info["chat_template"] == CHAT_TEMPLATE and info["eos_token"] == "<|endoftext|>"
    assert info["model_max_length"] == CONTEXT and info["add_bos_token"] is False


def test_invocations_answer_a_chat_and_a_completion_as_their_routes_do(daemon):
    chat = {"messages": MESSAGES[:1], **REPLY}
    completion = {"prompt": "the quick brown fox", **REPLY}
    for body, path in ((chat, "chat/completions"), (completion, "completions")):
        routed = ok(post(daemon, "../invocations", body))
        assert routed["object"] == ok(post(daemon, path, body))["object"]
        assert routed["choices"][0]["token_ids"] == ok(post(daemon, path, body))["choices"][0]["token_ids"]

"""Streamed OpenAI replies as vLLM's own tests read them, and vLLM's prompt truncation, against the
real daemon (two ranks, a tiny random model) on loopback:

- a choice's finish reason comes in the chunk with its last text, once (not in an empty chunk after);
- stream_options.continuous_usage_stats puts the usage so far in every chunk;
- truncate_prompt_tokens (and truncation_side) cuts the prompt, over HTTP and gRPC alike;
- return_token_ids shows the prompt's token ids that ran.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from daemon import read_reply, running_daemon, write_daemon_model
from test_http_api import post

from tpserve.server.openai_stream_choice import ChoiceChunks
from tpserve.server.requests import Usage
from tpserve.v1 import serving_pb2

PROMPT_IDS = list(range(100, 112))  # 12 byte tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("stream-model"))
    log_dir = tmp_path_factory.mktemp("stream-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", "256", "--lanes", "4") as served:
        yield served


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def completion_chunks(client, extra: dict | None = None, temperature: float = 0.0, **fields) -> list:
    body = {"ignore_eos": True, **(extra or {})}
    return list(
        client.completions.create(
            model=None, prompt=PROMPT_IDS, stream=True, temperature=temperature, extra_body=body, **fields
        )
    )


def test_a_streamed_reply_names_its_finish_reason_in_its_last_text_chunk(client):
    whole = client.completions.create(
        model=None, prompt=PROMPT_IDS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = completion_chunks(client, max_tokens=8)
    reasons = [chunk.choices[0].finish_reason for chunk in chunks]
    assert reasons == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].choices[0].text  # the last chunk carries text, not only the reason
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text

    messages = [{"role": "user", "content": "hello there"}]
    chat = list(
        client.chat.completions.create(
            model=None, messages=messages, max_tokens=6, temperature=0, stream=True
        )
    )
    reasons = [chunk.choices[0].finish_reason for chunk in chat]
    assert reasons.count("length") == 1 and reasons[-1] == "length"
    assert chat[-1].choices[0].delta.content
    assert chat[0].choices[0].delta.role == "assistant"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = completion_chunks(client, max_tokens=6, stream_options=options)
    *texts, last = chunks
    counts = [chunk.usage.completion_tokens for chunk in texts]
    assert counts == sorted(set(counts)) and counts[0] >= 1  # rising with every chunk
    assert all(chunk.usage.prompt_tokens == len(PROMPT_IDS) for chunk in chunks)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert texts[-1].choices[0].finish_reason == "length" and texts[-1].usage.completion_tokens == 6
    assert last.choices == [] and last.usage.completion_tokens == 6

    # Without include_usage it asks for nothing (as vLLM reads it); the plain usage chunk is unchanged.
    quiet = completion_chunks(client, max_tokens=6, stream_options={"continuous_usage_stats": True})
    assert all(chunk.usage is None for chunk in quiet)
    plain = completion_chunks(client, max_tokens=6, stream_options={"include_usage": True})
    assert [chunk.usage is None for chunk in plain] == [True] * (len(plain) - 1) + [False]
    with pytest.raises(openai.BadRequestError, match="stream_options has no field 'include_usages'"):
        completion_chunks(client, max_tokens=6, stream_options={"include_usages": True})

    chat = list(
        client.chat.completions.create(
            model=None,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,  # greedy: no early end
            stream=True,
            stream_options=options,
        )
    )
    assert chat[0].usage.completion_tokens == 0  # the role's chunk
    assert [c.usage.completion_tokens for c in chat[1:-1]][-1] == 5 and chat[-1].choices == []

    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=None, prompt=PROMPT_IDS, max_tokens=2, stream_options=options)


def test_truncate_prompt_tokens_runs_the_prompts_last_or_first_tokens(daemon, client):
    def reply(prompt, **extra):
        body = {"return_token_ids": True, "ignore_eos": True, **extra}
        whole = client.completions.create(
            model=None, prompt=prompt, max_tokens=6, temperature=0, extra_body=body
        )
        choice = whole.choices[0]
        return (
            choice.model_extra["prompt_token_ids"],
            choice.model_extra["token_ids"],
            whole.usage.prompt_tokens,
        )

    kept, tokens, counted = reply(PROMPT_IDS, truncate_prompt_tokens=4)
    assert kept == PROMPT_IDS[-4:] and counted == 4
    assert tokens == reply(PROMPT_IDS[-4:])[1]  # exactly the reply to the last four tokens alone
    kept, tokens, _ = reply(PROMPT_IDS, truncate_prompt_tokens=4, truncation_side="right")
    assert kept == PROMPT_IDS[:4] and tokens == reply(PROMPT_IDS[:4])[1]
    assert reply(PROMPT_IDS, truncate_prompt_tokens=50)[0] == PROMPT_IDS  # shorter: whole
    assert reply(PROMPT_IDS, truncate_prompt_tokens=-1)[0] == PROMPT_IDS  # -1: the context size

    # The streamed reply's first chunk shows the prompt that ran, too.
    chunks = completion_chunks(
        client, max_tokens=3, extra={"return_token_ids": True, "truncate_prompt_tokens": 5}
    )
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == PROMPT_IDS[-5:]

    # gRPC's field cuts the same way.
    cut = serving_pb2.GenerateRequest(
        prompt_token_ids=PROMPT_IDS, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=4
    )
    assert read_reply(daemon.stub.Generate(cut, timeout=60)).token_ids == reply(PROMPT_IDS[-4:])[1]

    for fields, named in (
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
    ):
        refused = post(daemon, "completions", {"prompt": PROMPT_IDS, "max_tokens": 2, **fields})
        assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text
    bad = serving_pb2.GenerateRequest(prompt_token_ids=PROMPT_IDS, max_tokens=2, truncate_prompt_tokens=-2)
    assert read_reply(daemon.stub.Generate(bad, timeout=60)).details.startswith("truncate_prompt_tokens")


def test_a_chunk_waits_for_the_finish_only_when_the_reply_may_be_over():
    def chunk(text):
        return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}

    usage = Usage(
        prompt_tokens=3, completion_tokens=3, cached_tokens=0, time_to_first_token_s=None, total_s=0.0
    )
    out = ChoiceChunks((1, 2, 3), max_tokens=3, continuous_usage=True)
    out.count(1)
    assert out.add(chunk("a")) == [] and [c["choices"][0]["text"] for c in out.end_read()] == ["a"]
    out.count(2)
    assert out.add(chunk("bc")) == [] and out.end_read() == []  # at max_tokens: held for the reason
    (last,) = out.finish(chunk(""), usage)
    assert last["choices"][0]["text"] == "bc" and last["usage"]["completion_tokens"] == 3

    # A stop token in a later read: its reason comes alone, in the empty chunk.
    out = ChoiceChunks((1,), max_tokens=8)
    out.count(1)
    out.add(chunk("a"))
    assert len(out.end_read()) == 1
    reason = chunk("")
    reason["choices"][0]["finish_reason"] = "stop"
    assert out.finish(reason, usage) == [reason] and "usage" not in reason


def test_an_http_stream_reads_like_vllms_for_a_raw_sse_client(daemon):
    """The bytes on the wire: the last data line before the usage and [DONE] holds text and reason."""
    body = {"prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{daemon.http_url}/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2] and '"text":""' not in lines[-2]

"""vLLM's extensions that its own server tests use, against the real daemon (two ranks, a tiny random
model) on loopback: beam search (`use_beam_search`, `length_penalty`), the whole vocabulary's log
probabilities (-1, where --max-logprobs allows it), custom chat roles, "true" as a flag, and
replies that read as the openai package models them (/invocations too). Beam searches and
whole-vocabulary replies are the same alone and beside other traffic.
"""

from __future__ import annotations

import math
import threading

import httpx
import openai
import pytest
from daemon import running_daemon, write_daemon_model
from test_http_api import post
from transformers import AutoTokenizer

VOCAB = 259  # tests/daemon.py's byte-level model
MAX_LOGPROBS = 300  # above the vocabulary: -1 (all of it) is allowed
PROMPT = "the quick brown fox"
CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("extras-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("extras-logs")
    args = ("--context", "256", "--lanes", "4", "--max-logprobs", str(MAX_LOGPROBS))
    with running_daemon("spawn", model_dir, log_dir, *args) as served:
        yield served


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def beams(daemon, prompt=PROMPT, n=2, **fields) -> list[dict]:
    body = {"prompt": prompt, "n": n, "max_tokens": 6, "temperature": 0.0, "use_beam_search": True}
    body.update({"ignore_eos": True, "return_token_ids": True, **fields})
    return ok(post(daemon, "completions", body))["choices"]


def test_beam_search_answers_n_distinct_beams_and_width_one_is_greedy(daemon):
    greedy = ok(post(daemon, "completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                                             "ignore_eos": True, "return_token_ids": True}))  # fmt: skip
    (one,) = beams(daemon, n=1)
    assert (
        one["token_ids"] == greedy["choices"][0]["token_ids"] and one["text"] == greedy["choices"][0]["text"]
    )
    three = beams(daemon, n=3)
    assert [c["index"] for c in three] == [0, 1, 2] and all(c["finish_reason"] == "length" for c in three)
    assert len({tuple(c["token_ids"]) for c in three}) == 3
    # A prompt list: each prompt's beams in turn, as vLLM's own test reads them.
    listed = beams(daemon, prompt=[PROMPT, PROMPT])
    texts = [c["text"] for c in listed]
    assert texts[:2] == texts[2:] and texts[0] != texts[1]
    chat = ok(post(daemon, "chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 4,
                                                "use_beam_search": True, "ignore_eos": True}))  # fmt: skip
    assert len({c["message"]["content"] for c in chat["choices"]}) == 2


def test_length_penalty_changes_only_the_final_ranking(daemon):
    # Without an ending token every beam has the same length, so the penalty cannot reorder them.
    plain = beams(daemon, n=3)
    assert beams(daemon, n=3, length_penalty=2.0) == plain


def test_a_beam_search_and_a_whole_vocabulary_reply_are_the_same_beside_other_traffic(daemon):
    vocab_body = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": -1}
    alone = [
        beams(daemon, n=3),
        beams(daemon, prompt="hello world", n=2),
        ok(post(daemon, "chat/completions", vocab_body)),
    ]
    together: list = [None] * 4

    def run(i):
        if i == 0:
            together[i] = beams(daemon, n=3)
        elif i == 1:
            together[i] = beams(daemon, prompt="hello world", n=2)
        elif i == 2:
            together[i] = ok(post(daemon, "chat/completions", vocab_body))
        else:  # plain sampled traffic in the same passes
            together[i] = ok(
                post(daemon, "completions", {"prompt": "zebra", "max_tokens": 24, "temperature": 1.0})
            )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert together[:2] == alone[:2]
    assert together[2]["choices"][0]["logprobs"] == alone[2]["choices"][0]["logprobs"]


def test_beam_search_refuses_by_name_what_it_cannot_honour(daemon):
    for fields, param in (
        ({"stream": True}, "stream"),
        ({"logprobs": 1}, "logprobs"),
        ({"temperature": 0.7}, "temperature"),
        ({"stop": ["x"]}, "stop"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
    ):
        body = {"prompt": PROMPT, "n": 2, "max_tokens": 4, "use_beam_search": True, **fields}
        refused(post(daemon, "completions", body), param)
    assert refused(
        post(daemon, "completions", {"prompt": PROMPT, "length_penalty": 2.0}), "length_penalty"
    ) == ("length_penalty needs use_beam_search: true")


def test_minus_one_asks_the_whole_vocabulary_and_a_string_true_is_a_flag(daemon):
    body = {"messages": CHAT, "max_tokens": 1, "logprobs": "true", "top_logprobs": -1}
    (entry,) = ok(post(daemon, "chat/completions", body))["choices"][0]["logprobs"]["content"]
    assert len(entry["top_logprobs"]) == VOCAB == len({e["token_id"] for e in entry["top_logprobs"]})
    assert math.isclose(sum(math.exp(e["logprob"]) for e in entry["top_logprobs"]), 1.0, rel_tol=1e-6)
    five = ok(post(daemon, "chat/completions", {**body, "logprobs": True, "top_logprobs": 5}))
    assert five["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == entry["top_logprobs"][:5]
    prompt = ok(post(daemon, "chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": -1}))
    rows = prompt["prompt_logprobs"]
    assert rows[0] is None and all(len(row) == VOCAB for row in rows[1:])
    assert refused(post(daemon, "chat/completions", {**body, "logprobs": "maybe"}), "logprobs")


def test_a_custom_role_reaches_the_chat_template(daemon, model_dir):
    custom = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    tokens = ok(post(daemon, "../tokenize", {"messages": custom}))["tokens"]
    reference = AutoTokenizer.from_pretrained(model_dir)
    text = reference.apply_chat_template(custom, add_generation_prompt=True, tokenize=False)
    assert tokens == reference.encode(text, add_special_tokens=False)
    parts = [{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}]
    replies = [
        ok(
            post(
                daemon,
                "chat/completions",
                {"messages": m, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            )
        )
        for m in (custom, parts)
    ]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]
    empty = [{"role": "", "content": "x"}]
    assert refused(post(daemon, "chat/completions", {"messages": empty}), "messages[0].role") == (
        "messages[0].role is empty"
    )


def test_replies_read_as_the_openai_package_models_them_invocations_too(daemon):
    body = {"messages": CHAT, "max_completion_tokens": 5, "temperature": 0.0, "logprobs": False}
    with openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=60) as client:
        modelled = client.chat.completions.create(model=None, **body).model_dump()
    raw = ok(post(daemon, "../invocations", body))
    assert modelled.keys() == raw.keys() and modelled["choices"] == raw["choices"]


def test_a_seed_past_int64_is_refused_in_pydantics_words(daemon):
    for seed, kind in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        assert kind in refused(post(daemon, "chat/completions", {"messages": CHAT, "seed": seed}), "seed")

"""The sampling surface over the OpenAI API, against the real two-rank daemon on loopback: the
penalties, logit_bias, min_tokens, stop_token_ids and include_stop_str_in_output each change the
reply as they say, and a reply is the same alone or batched with others (position-keyed draws on
rank 0, the logits adjusted per stream); the fixed bugs of issue 24 stay fixed.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from daemon import read_reply, running_daemon, write_daemon_model
from test_http_api import post

from tpserve.v1 import serving_pb2

PROMPT = "the quick brown fox"
SAMPLED = {"temperature": 0.9, "seed": 7}
ADJUSTED = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0, "presence_penalty": 2.0, **SAMPLED},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6, "frequency_penalty": -0.4, **SAMPLED},
    {"logit_bias": {"101": 30.0, "102": -100}},
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model_dir = write_daemon_model(tmp_path_factory.mktemp("sampling-model"))
    log_dir = tmp_path_factory.mktemp("sampling-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", "512", "--lanes", "4") as served:
        yield served


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def complete(client, max_tokens=16, temperature=0.0, **fields):
    """Greedy unless `temperature` says otherwise (openai.omit: unset, the server's default)."""
    fields["temperature"] = temperature
    extra = {key: fields.pop(key) for key in list(fields) if key not in ("temperature", "seed", "stop")}
    extra.setdefault("ignore_eos", True)
    extra["return_token_ids"] = True
    reply = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=max_tokens, extra_body=extra, **fields
    )
    (choice,) = reply.choices
    return choice.text, choice.model_extra["token_ids"], choice.finish_reason, reply.usage


def test_each_adjustment_changes_the_reply_and_batched_equals_alone(client):
    sampled, greedy = complete(client, **SAMPLED)[1], complete(client)[1]
    cases = [*ADJUSTED, {"min_tokens": 6, "stop_token_ids": [greedy[2]]}]  # barred where greedy has it
    alone = [complete(client, **dict(fields)) for fields in cases]
    for fields, (_, token_ids, _, usage) in zip(cases, alone):
        assert token_ids != (sampled if "seed" in fields else greedy), f"{fields} changed nothing"
        assert usage.completion_tokens == len(token_ids)
    together: list = [None] * (2 * len(cases))

    def run(i):
        together[i] = complete(client, **dict(cases[i % len(cases)]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(together))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert [what_it_says(reply) for reply in together] == [what_it_says(reply) for reply in alone * 2]


def what_it_says(reply):
    """A reply less its cached_tokens, which depend on what else is live: batched, a prompt may copy
    the prefix a lane beside it is computing."""
    text, token_ids, finish_reason, usage = reply
    return text, token_ids, finish_reason, usage.completion_tokens, usage.prompt_tokens


def test_penalties_are_what_they_say(client):
    _, greedy, _, _ = complete(client, max_tokens=24)
    # A large frequency penalty makes every token of the greedy reply different from the one before.
    _, spread, _, _ = complete(client, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(spread)) > len(set(greedy))
    _, forced, _, _ = complete(client, logit_bias={"104": 100})
    assert forced == [104] * 16


def test_stop_token_ids_end_the_reply_and_min_tokens_holds_them_back(client):
    _, greedy, _, _ = complete(client)
    stop_id = greedy[2]
    text, token_ids, reason, usage = complete(client, stop_token_ids=[stop_id])
    first = greedy.index(stop_id)
    assert (reason, token_ids) == ("stop", greedy[: first + 1])  # the stop token's id is sent, no text
    assert usage.completion_tokens == len(token_ids)
    _, held, _, _ = complete(client, stop_token_ids=[stop_id], min_tokens=first + 3)
    assert stop_id not in held[: first + 3] and len(held) >= first + 3


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    full, _, _, _ = complete(client)
    stop = full[4:7]
    cut, token_ids, reason, usage = complete(client, stop=[stop])
    kept, _, _, _ = complete(client, stop=[stop], include_stop_str_in_output=True)
    assert reason == "stop" and kept == cut + stop == full[: full.index(stop) + len(stop)]
    assert usage.completion_tokens == len(token_ids)  # return_token_ids has the stop string's tokens


def test_grpc_takes_the_same_fields_and_gives_the_same_reply(daemon, client):
    _, http_ids, _, _ = complete(client, frequency_penalty=1.0, logit_bias={"101": 3.0}, **SAMPLED)
    request = serving_pb2.GenerateRequest(
        prompt=PROMPT, max_tokens=16, ignore_eos=True, frequency_penalty=1.0
    )
    request.logit_bias[101] = 3.0
    request.temperature, request.seed = SAMPLED["temperature"], SAMPLED["seed"]
    assert read_reply(daemon.stub.Generate(request, timeout=60)).token_ids == http_ids


def test_completion_logprobs_list_the_sampled_token_among_the_top(client):
    for k in (0, 2):
        reply = client.completions.create(
            model=None,
            prompt=PROMPT,
            max_tokens=6,
            logprobs=k,
            temperature=1.0,
            seed=3,
            extra_body={"ignore_eos": True},
        )
        logprobs = reply.choices[0].logprobs
        for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            # At most k + 1 entries: tokens whose text is the same (bytes of one character) share a key.
            assert top[token] == logprob and len(top) <= k + 1 and (k > 0 or len(top) == 1)


def test_stream_options_without_stream_and_a_form_body_are_refused(daemon, client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=None, prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True}
        )
    assert (raised.value.body["param"], raised.value.body["message"]) == (
        "stream_options",
        "stream_options needs stream: true",
    )
    body = '{"prompt": "hi", "max_tokens": 2}'
    form = httpx.post(
        f"{daemon.http_url}/completions",
        content=body,
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=30,
    )
    assert form.status_code == 400
    assert form.json()["error"]["message"] == (
        "the request body must be application/json (got 'application/x-www-form-urlencoded')"
    )
    assert post(daemon, "completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def post_root(daemon, path: str, body: dict) -> httpx.Response:
    """vLLM's routes outside /v1."""
    return httpx.post(f"{daemon.http_url.removesuffix('/v1')}/{path}", json=body, timeout=60)


def test_tokenize_detokenize_and_version_answer_as_vllm_does(daemon):
    grpc_ids = daemon.stub.Tokenize(serving_pb2.TokenizeRequest(text=PROMPT), timeout=30).token_ids
    reply = post_root(daemon, "tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert reply.status_code == 200
    body = reply.json()
    assert (
        body["tokens"] == list(grpc_ids) and body["count"] == len(grpc_ids) and body["max_model_len"] == 512
    )
    # vLLM's token_strs are the vocabulary's own spellings (byte-level: a space is "Ġ"), as
    # transformers' convert_ids_to_tokens gives them
    assert "".join(body["token_strs"]).replace("\u0120", " ") == PROMPT
    chat = post_root(daemon, "tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["count"] > 2
    back = post_root(daemon, "detokenize", {"tokens": body["tokens"]})
    assert back.json() == {"prompt": PROMPT}
    outside = post_root(daemon, "detokenize", {"tokens": [5, 100000]})
    assert outside.status_code == 400
    assert outside.json()["error"]["message"] == "tokens[1] = 100000 is outside the vocabulary of 259 tokens"
    version = httpx.get(daemon.http_url.removesuffix("/v1") + "/version", timeout=30)
    assert version.status_code == 200 and version.json()["version"]


def test_an_unset_max_tokens_runs_to_the_end_of_the_context(client):
    reply = client.completions.create(model=None, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 512


@pytest.fixture(scope="module")
def tuned_daemon(tmp_path_factory):
    """A model whose generation_config.json sets sampling defaults (vLLM's --generation-config auto)."""
    model_dir = write_daemon_model(tmp_path_factory.mktemp("tuned-model"))
    (model_dir / "generation_config.json").write_text('{"temperature": 0.8, "top_k": 5, "do_sample": true}')
    log_dir = tmp_path_factory.mktemp("tuned-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", "128", "--lanes", "2") as served:
        yield served


def test_unset_sampling_fields_take_the_models_generation_config(tuned_daemon):
    with openai.OpenAI(base_url=tuned_daemon.http_url, api_key="unused", max_retries=0, timeout=60) as tuned:
        defaults = complete(tuned, temperature=openai.omit, seed=3)[1]
        assert defaults == complete(tuned, seed=3, temperature=0.8, top_k=5)[1]
        assert defaults != complete(tuned, seed=3, temperature=0.0)[1]  # set fields still win


def test_n_choices_are_separate_streams_seeded_seed_plus_index(client):
    reply = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=8, n=3, extra_body={"ignore_eos": True}, **SAMPLED
    )
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    for index, choice in enumerate(reply.choices):
        alone = complete(
            client, max_tokens=8, temperature=SAMPLED["temperature"], seed=SAMPLED["seed"] + index
        )
        assert choice.text == alone[0]
    assert len({choice.text for choice in reply.choices}) > 1
    assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens == alone[3].prompt_tokens
    chat = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, **SAMPLED
    )
    assert [choice.index for choice in chat.choices] == [0, 1]


def test_a_list_of_prompts_gets_a_choice_each_in_order_streamed_or_whole(client):
    prompts = ["one prompt", "another prompt here", [5, 6, 7]]
    whole = client.completions.create(
        model=None, prompt=prompts, max_tokens=6, n=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [choice.index for choice in whole.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(
            model=None, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert whole.choices[2 * i].text == whole.choices[2 * i + 1].text == alone.choices[0].text
    texts = [""] * 6
    chunks = client.completions.create(
        model=None,
        prompt=prompts,
        max_tokens=6,
        n=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [choice.text for choice in whole.choices]
    assert usage.completion_tokens == 36 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_echo_prepends_the_prompt_and_echo_with_logprobs_scores_it(client):
    greedy = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(model=None, prompt=PROMPT, **greedy)
    echoed = client.completions.create(model=None, prompt=PROMPT, echo=True, **greedy)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    scored = client.completions.create(model=None, prompt=PROMPT, echo=True, logprobs=1, **greedy)
    logprobs = scored.choices[
        0
    ].logprobs  # the prompt's tokens, then the reply's (tests/test_prompt_logprobs.py)
    assert "".join(logprobs.tokens) == scored.choices[0].text == echoed.choices[0].text
    assert logprobs.token_logprobs[0] is None and all(v is not None for v in logprobs.token_logprobs[1:])


def test_the_http_port_serves_vllms_metric_names_beside_tpserves(daemon, client):
    complete(client, max_tokens=3)
    name = client.models.list().data[0].id
    text = httpx.get(daemon.http_url.removesuffix("/v1") + "/metrics", timeout=30).text
    label = f'{{model_name="{name}"}}'
    for series in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"{series}{label}" in text
    for series in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert f"{series}_count{label}" in text
    counts = [
        line
        for line in text.splitlines()
        if line.startswith(f"vllm:e2e_request_latency_seconds_count{label}")
    ]
    assert counts and float(counts[0].split()[-1]) >= 1
    assert "tpserve_requests_total" in text and f"vllm:generation_tokens_total{label}" in text

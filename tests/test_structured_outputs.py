"""Structured outputs against the real two-rank daemon over loopback: every spelling of a constraint
(OpenAI's response_format, vLLM's structured_outputs and guided_* fields, gRPC's Constraint) gives
a reply that matches it, from a random tiny model that would otherwise write bytes at random; and a
constrained reply is the same alone as beside other streams.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import openai
import pytest
from daemon import read_reply, running_daemon, write_daemon_model
from pydantic import BaseModel, ConfigDict, Field

from tpserve.v1 import serving_pb2

CONTEXT = 512
MESSAGES = [{"role": "user", "content": "Describe a city."}]


class City(BaseModel):
    # No properties beyond these (a schema allows any others by default, and a random model takes
    # that door into an endless property name).
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=8)
    size: Literal["small", "large"]
    rank: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("structured-model"))


@pytest.fixture(scope="module")
def daemon(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("structured-logs")
    with running_daemon("spawn", model_dir, log_dir, "--context", str(CONTEXT), "--lanes", "4") as served:
        yield served


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        client.served_model = client.models.list().data[0].id
        yield client


def chat(client, **fields):
    fields = {"max_tokens": 120} | fields
    return client.chat.completions.create(model=client.served_model, messages=MESSAGES, **fields)


def test_parse_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model=client.served_model, messages=MESSAGES, response_format=City, max_tokens=120, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_is_a_json_object(client):
    reply = chat(client, response_format={"type": "json_object"}, max_tokens=60, temperature=1.0, seed=3)
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert content.startswith("{")


@pytest.mark.parametrize(
    "fields",
    [
        {"extra_body": {"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}},
        {"extra_body": {"guided_regex": "[a-c]{3}-[0-9]{2}"}},
        {"extra_body": {"structured_outputs": {"grammar": 'root ::= [a-c] [a-c] [a-c] "-" [0-9] [0-9]'}}},
        {"extra_body": {"structured_outputs": {"grammar": 'start: /[a-c]{3}/ "-" /[0-9]{2}/'}}},
    ],
    ids=["structured_outputs.regex", "guided_regex", "gbnf", "lark"],
)
def test_regex_and_grammar_replies_match(client, fields):
    for seed in range(3):
        reply = chat(client, temperature=1.0, seed=seed, **fields)
        assert reply.choices[0].finish_reason == "stop"
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", reply.choices[0].message.content)


def test_a_choice_reply_is_one_of_the_choices(client):
    choices = ["sunny", "rain", "snow storm"]
    seen = set()
    for seed in range(4):
        for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
            reply = chat(client, temperature=1.0, seed=seed, extra_body=extra)
            assert reply.choices[0].message.content in choices
            seen.add(reply.choices[0].message.content)
    assert seen  # at least one; which ones depends on the random model


def test_grpc_constraint_gives_the_http_reply(daemon, client):
    schema = City.model_json_schema()
    http = chat(client, extra_body={"guided_json": schema}, temperature=0.7, seed=11)
    request = serving_pb2.GenerateRequest(
        messages=[serving_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])],
        max_tokens=120,
        temperature=0.7,
        seed=11,
        constraint=serving_pb2.Constraint(json_schema=json.dumps(schema)),
    )
    reply = read_reply(daemon.stub.Generate(request, timeout=120))
    assert reply.ok
    assert reply.text == http.choices[0].message.content
    City.model_validate_json(reply.text)


def test_a_constrained_reply_is_the_same_alone_and_batched(client):
    constrained = {"response_format": {"type": "json_object"}, "temperature": 1.0, "max_tokens": 40}
    solo = [chat(client, seed=seed, **constrained).choices[0].message.content for seed in range(3)]
    together: dict[int, str] = {}
    failures: list[BaseException] = []

    def run(seed: int, constrained_one: bool) -> None:
        try:
            fields = constrained if constrained_one else {"temperature": 1.0, "max_tokens": 40}
            content = chat(client, seed=seed, **fields).choices[0].message.content
            if constrained_one:
                together[seed] = content
        except BaseException as error:  # noqa: BLE001 (reported below)
            failures.append(error)

    threads = [threading.Thread(target=run, args=(seed, True)) for seed in range(3)]
    threads += [threading.Thread(target=run, args=(seed, False)) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert failures == []
    assert [together[seed] for seed in range(3)] == solo


def test_a_constrained_reply_is_the_same_at_tp1_and_tp2(client, model_dir, tmp_path):
    fields = {"extra_body": {"guided_json": City.model_json_schema()}, "temperature": 0.9, "seed": 21}
    tp2 = chat(client, **fields).choices[0].message.content
    with (
        running_daemon("spawn", model_dir, tmp_path, "--context", str(CONTEXT), "--tp", "1") as one_rank,
        openai.OpenAI(base_url=one_rank.http_url, api_key="unused", max_retries=0, timeout=120) as other,
    ):
        other.served_model = client.served_model
        assert chat(other, **fields).choices[0].message.content == tp2
    City.model_validate_json(tp2)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"guided_regex": "[0-9"}, None, "the regex does not compile: "),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type 'xml' is not one of"),
        (
            {"structured_outputs": {"structural_tag": "x"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain the reply"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, extra_body=body)
    error = raised.value.body
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param

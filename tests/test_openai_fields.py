"""The OpenAI bodies' fields as tpserve/server/openai_fields.py lists them: each is honoured, accepted
without effect, or refused by name; an unknown field is refused, never ignored.

Parsing only (no daemon): tests/test_http_api.py and tests/test_openai_sampling.py send the same
bodies to the real server.
"""

from __future__ import annotations

import pytest

from tpserve.server.openai_fields import FIELDS, HONOURED, NO_EFFECT, OWNER_24G, REFUSED, FieldRefused
from tpserve.server.openai_request import parse_chat, parse_completion

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def refusal(parse, body: dict) -> tuple[str, str]:
    with pytest.raises(FieldRefused) as raised:
        parse(body)
    return raised.value.param, raised.value.message


@pytest.mark.parametrize(
    "name", ["guided_decoding_backend", "structural_tag", "reasoning_effort", "functions"]
)
def test_fields_other_servers_honour_are_refused_by_name_when_set(name):
    assert refusal(parse_chat, {**CHAT, name: {"x": 1}}) == (name, f"{name} is not supported by this server")


def test_priority_other_than_first_come_first_served_is_refused():
    assert refusal(parse_completion, {**COMPLETION, "priority": 5}) == (
        "priority",
        "priority is not supported by this server",
    )
    parse_completion({**COMPLETION, "priority": 0})


def test_an_unknown_field_is_refused_not_ignored():
    assert refusal(parse_chat, {**CHAT, "temprature": 0.5}) == (
        "temprature",
        "temprature is not a field of /v1/chat/completions this server knows",
    )
    # A field of the other API is unknown here.
    assert refusal(parse_completion, {**COMPLETION, "max_completion_tokens": 4}) == (
        "max_completion_tokens",
        "max_completion_tokens is not a field of /v1/completions this server knows",
    )


def test_neutral_values_and_bookkeeping_fields_are_accepted():
    body = {**CHAT, "user": "u", "metadata": {"k": "v"}, "store": False, "n": 1, "tools": []}
    body |= {"response_format": {"type": "text"}, "echo": False, "tool_choice": "none", "priority": None}
    parse_chat(body)


def test_every_field_has_one_handling_and_the_grammar_fields_are_honoured():
    assert {field.handling for field in FIELDS.values()} == {HONOURED, NO_EFFECT, REFUSED}
    for name in ("response_format", "structured_outputs", "tools", "tool_choice", "chat_template_kwargs"):
        assert FIELDS[name].handling == HONOURED
    assert FIELDS["reasoning_effort"].handling == REFUSED and FIELDS["reasoning_effort"].owner == OWNER_24G


def test_min_characters_is_no_field_of_vllms_and_is_refused():
    # vLLM's own test sends it; vLLM's models drop unknown fields with a warning, this server names them.
    assert refusal(parse_chat, {**CHAT, "min_characters": 10}) == (
        "min_characters",
        "min_characters is not a field of /v1/chat/completions this server knows",
    )


def test_beam_search_fields_are_honoured_and_what_a_search_cannot_honour_is_named():
    parsed = parse_completion({**COMPLETION, "n": 3, "use_beam_search": True, "length_penalty": 0.5})
    assert (parsed.beam.width, parsed.beam.length_penalty) == (3, 0.5)
    assert parse_completion({**COMPLETION, "use_beam_search": False}).beam is None
    assert refusal(parse_chat, {**CHAT, "use_beam_search": True, "top_p": 0.5}) == (
        "top_p",
        "top_p is not supported with use_beam_search",
    )
    assert refusal(parse_completion, {**COMPLETION, "use_beam_search": True, "echo": True})[0] == "echo"
    assert refusal(parse_completion, {**COMPLETION, "use_beam_search": "yes"})[0] == "use_beam_search"


def test_true_and_false_as_strings_are_flags():
    assert parse_chat({**CHAT, "logprobs": "true", "top_logprobs": 3}).generate.logprobs == 3
    assert not parse_chat({**CHAT, "logprobs": "False"}).generate.HasField("logprobs")
    assert refusal(parse_chat, {**CHAT, "stream": "yes"}) == (
        "stream",
        "stream must be true or false (got 'yes')",
    )

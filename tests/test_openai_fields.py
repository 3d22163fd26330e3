"""The OpenAI bodies' fields as server/openai_fields.py lists them: each is honoured, accepted
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

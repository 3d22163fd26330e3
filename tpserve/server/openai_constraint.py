"""Structured-output fields of an OpenAI body -> a tpserve.v1 Constraint.

Three spellings reach the same constraint: OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`) and vLLM's
older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. A request sets at
most one; a key this server does not honour is refused by name, never ignored. Whether the grammar
compiles is tpserve/server/grammar.py's to say (after this, on both APIs).
"""

from __future__ import annotations

import json

from tpserve.server.openai_fields import FieldRefused
from tpserve.v1 import serving_pb2

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def constraint_from(body: dict) -> serving_pb2.Constraint | None:
    """The body's one structured-output constraint, or None when it asks for free text."""
    found: list[tuple[str, serving_pb2.Constraint]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(("structured_outputs", _structured(structured)))
    for name, key in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _one(name, key, body[name])))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise FieldRefused(found[1][0], f"{names} both constrain the reply; send one")
    return found[0][1] if found else None


def _response_format(value) -> serving_pb2.Constraint | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return serving_pb2.Constraint(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise FieldRefused("response_format", "response_format.json_schema.schema is missing")
        return _one("response_format.json_schema.schema", "json", spec["schema"])
    raise FieldRefused(
        "response_format", f"response_format.type {kind!r} is not one of text, json_object, json_schema"
    )


def _structured(value) -> serving_pb2.Constraint:
    if not isinstance(value, dict):
        raise FieldRefused("structured_outputs", "structured_outputs must be an object")
    unknown = sorted(key for key, item in value.items() if key not in STRUCTURED_KEYS and item is not None)
    if unknown:
        raise FieldRefused(
            f"structured_outputs.{unknown[0]}",
            f"structured_outputs.{unknown[0]} is not supported by this server "
            f"(it honours {', '.join(STRUCTURED_KEYS)})",
        )
    set_keys = [key for key in STRUCTURED_KEYS if value.get(key) not in (None, False)]
    if len(set_keys) != 1:
        raise FieldRefused(
            "structured_outputs", f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KEYS)}"
        )
    key = set_keys[0]
    return _one(f"structured_outputs.{key}", key, value[key])


def _one(where: str, key: str, value) -> serving_pb2.Constraint:
    """One constraint of kind `key` (json, regex, choice, grammar, json_object) from `value`."""
    if key == "json_object":
        if value is not True:
            raise FieldRefused(where, f"{where} must be true")
        return serving_pb2.Constraint(json_object=True)
    if key == "json":
        if isinstance(value, str):
            return serving_pb2.Constraint(json_schema=value)
        if isinstance(value, (dict, bool)):
            return serving_pb2.Constraint(json_schema=json.dumps(value))
        raise FieldRefused(where, f"{where} must be a JSON schema (an object, or its JSON text)")
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise FieldRefused(where, f"{where} must be a list of strings")
        return serving_pb2.Constraint(choice=serving_pb2.ChoiceList(choices=value))
    if not isinstance(value, str) or not value:
        raise FieldRefused(where, f"{where} must be a non-empty string")
    if key == "regex":
        return serving_pb2.Constraint(regex=value)
    return serving_pb2.Constraint(grammar=value)

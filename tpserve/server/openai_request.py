"""OpenAI JSON bodies -> tpserve.v1 GenerateRequest, so the HTTP API shares gRPC's checks and wording.

This checks only what the proto cannot hold or the OpenAI API adds (types, lists of prompts, `n`,
fields this server does not support), naming the field; every range check and its wording stays
in tpserve/server/validation.py. Unset sampling fields take the server's defaults, as on gRPC, but for an
unset temperature: the HTTP API passes vLLM's (ServingInfo.openai_temperature, 1.0 by default).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, replace

from tpserve.server.openai_beam import BeamRequest, beam_from
from tpserve.server.openai_choices import choice_requests
from tpserve.server.openai_constraint import constraint_from
from tpserve.server.openai_fields import CHAT, COMPLETION, FieldRefused, check_fields
from tpserve.server.openai_tools import add_message_tools, add_tools
from tpserve.server.tool_calls import ToolMode
from tpserve.server.validation import MAX_SEED, seed_too_large
from tpserve.v1 import serving_pb2

INT32_MAX = 2**31 - 1
PART_TYPES = ("text", "image_url", "video_url", "input_audio")


STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}  # what stream_options may hold


@dataclass(frozen=True)
class OpenAIRequest:
    """One chat or completion request: the GenerateRequests to run (one per choice, in choice order)
    and how to answer them."""

    choices: tuple[serving_pb2.GenerateRequest, ...]
    chat: bool  # chat.completion objects, else text_completion
    model: str | None  # None: whatever this server serves
    stream: bool  # server-sent events, else one JSON object
    include_usage: bool  # a last streamed chunk with the usage (stream_options.include_usage)
    return_token_ids: bool  # token_ids in each choice (an extension, as vLLM's)
    tools: ToolMode | None = None  # how a chat reply's tool calls are read (tpserve/server/tool_calls.py)
    # Completions: each choice's text begins with its prompt's; chat (vLLM's): with the last
    # message's, where the reply continues its role.
    echo: bool = False
    # Where the prompt's log probabilities go: with echo and logprobs, in front of the reply's
    # (OpenAI's legacy lists); with vLLM's prompt_logprobs, in their own `prompt_logprobs` list.
    echo_logprobs: bool = False
    prompt_logprobs: bool = False
    num_per_prompt: int = 1  # n: choices i * n .. i * n + n - 1 answer prompt i
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk's usage so far.
    continuous_usage: bool = False
    beam: BeamRequest | None = None  # vLLM's use_beam_search: each prompt's n best beams instead
    include_reasoning: bool = True  # vLLM's: false reads the reasoning out of a chat reply and drops it

    @property
    def generate(self) -> serving_pb2.GenerateRequest:
        """The first choice's request (every choice asks the same but for its prompt and seed)."""
        return self.choices[0]


def parse_chat(
    body: dict, tool_parser: str | None = None, default_temperature: float | None = None
) -> OpenAIRequest:
    """`tool_parser`: the family of the model's tool calls (tool_calls.py), None if it has none.
    `default_temperature`: an unset temperature's value (None leaves it unset: gRPC's default)."""
    check_fields(body, CHAT)
    request = serving_pb2.GenerateRequest()
    add_messages(request, body.get("messages"))
    wants_logprobs = _flag(body, "logprobs")
    num_top = None if body.get("top_logprobs") is None else _int32("top_logprobs", body["top_logprobs"])
    if num_top and not wants_logprobs:
        raise FieldRefused("top_logprobs", "top_logprobs needs logprobs: true")
    if wants_logprobs:
        request.logprobs = num_top or 0
    if body.get("add_generation_prompt") is not None:
        request.add_generation_prompt = _flag(body, "add_generation_prompt")
    request.continue_final_message = _flag(body, "continue_final_message")
    parsed = _finish(body, request, chat=True, default_temperature=default_temperature)
    tools = None
    for choice in parsed.choices:  # every choice's request offers the same tools
        tools = add_tools(body, choice, tool_parser)
    include_reasoning = body.get("include_reasoning") is None or _flag(body, "include_reasoning")
    return replace(parsed, tools=tools, echo=_flag(body, "echo"), include_reasoning=include_reasoning)


def parse_completion(body: dict, default_temperature: float | None = None) -> OpenAIRequest:
    check_fields(body, COMPLETION)
    request = serving_pb2.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]  # a batch of prompts
    else:
        prompts = [_prompt(prompt, "prompt")]
    if isinstance(prompts[0], str):
        request.prompt = prompts[0]
    else:
        request.prompt_token_ids.extend(prompts[0])
    if body.get("logprobs") is not None:
        request.logprobs = _int32("logprobs", body["logprobs"])
    echo = _flag(body, "echo")
    echo_logprobs = echo and request.HasField("logprobs")
    if echo_logprobs:  # lm-eval's loglikelihood: the prompt's tokens scored as the reply's
        request.prompt_logprobs = request.logprobs
    parsed = _finish(
        body, request, chat=False, more_prompts=prompts[1:], default_temperature=default_temperature
    )
    return replace(parsed, echo=echo, echo_logprobs=echo_logprobs)


def _prompt(prompt, where: str) -> str | list[int]:
    """One prompt: text, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(token) for token in prompt):
        if not all(-INT32_MAX - 1 <= token <= INT32_MAX for token in prompt):
            raise FieldRefused(where, f"{where} holds a token id out of range")
        return prompt
    if prompt == []:
        raise FieldRefused(where, f"{where} is empty")
    raise FieldRefused(where, f"{where} must be a string or a list of token ids")


def _finish(
    body: dict,
    request: serving_pb2.GenerateRequest,
    *,
    chat: bool,
    more_prompts: list = (),
    default_temperature: float | None = None,
) -> OpenAIRequest:
    max_tokens = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    if max_tokens is not None:
        request.max_tokens = _int32(name, max_tokens)
    for name in ("temperature", "top_p", "min_p"):
        if body.get(name) is not None:
            setattr(request, name, _number(name, body[name]))
    if not request.HasField("temperature") and default_temperature is not None:
        request.temperature = default_temperature
    if body.get("top_k") is not None:
        request.top_k = _int32("top_k", body["top_k"])  # 0 is off (vLLM's -1 is refused, as on gRPC)
    if body.get("seed") is not None:
        request.seed = _seed(body["seed"])
    request.stop.extend(_stop(body.get("stop")))
    _add_adjustments(body, request)
    asks_prompt_logprobs = body.get("prompt_logprobs") is not None
    if asks_prompt_logprobs:
        count = _int32("prompt_logprobs", body["prompt_logprobs"])
        request.prompt_logprobs = (
            max(count, request.prompt_logprobs) if request.HasField("prompt_logprobs") else count
        )
    request.ignore_eos = _flag(body, "ignore_eos")
    _add_truncation(body, request)
    skip = body.get("skip_special_tokens")
    if skip is not None and not isinstance(skip, bool):
        raise FieldRefused("skip_special_tokens", "skip_special_tokens must be true or false")
    request.keep_special_tokens = skip is False
    constraint = constraint_from(body)
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise FieldRefused("user", "user must be a string")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldRefused("model", "model must be a string")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise FieldRefused("stream_options", "stream_options must be an object")
    if options is not None and not stream:
        raise FieldRefused("stream_options", "stream_options needs stream: true")  # as OpenAI refuses it
    unknown = sorted(set(options or {}) - STREAM_OPTIONS)
    if unknown:
        raise FieldRefused(f"stream_options.{unknown[0]}", f"stream_options has no field {unknown[0]!r}")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    continuous = _flag(options or {}, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    n = 1 if body.get("n") is None else _int32("n", body["n"])
    if n < 1:
        raise FieldRefused("n", f"n must be at least 1 (got {n})")
    return OpenAIRequest(
        beam=beam_from(body, n),
        choices=choice_requests(request, list(more_prompts), n),
        num_per_prompt=n,
        chat=chat,
        model=model,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous,
        return_token_ids=_flag(body, "return_token_ids"),
        prompt_logprobs=asks_prompt_logprobs,
    )


def _add_adjustments(body: dict, request: serving_pb2.GenerateRequest) -> None:
    """The logit adjustments and stop tokens (ranges are validation's)."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            setattr(request, name, _number(name, body[name]))
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise FieldRefused("logit_bias", "logit_bias must be an object of token ids and biases")
        bad = [key for key in bias if not (isinstance(key, str) and key.lstrip("-").isdigit())]
        if bad:  # every bad key named at once, so one correction fixes the request
            raise FieldRefused("logit_bias", f"logit_bias keys {', '.join(map(repr, bad))} are not token ids")
        for key, value in bias.items():
            request.logit_bias[_int32("logit_bias", int(key))] = _number(f"logit_bias[{key}]", value)
    if body.get("min_tokens") is not None:
        request.min_tokens = _int32("min_tokens", body["min_tokens"])
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise FieldRefused("stop_token_ids", "stop_token_ids must be a list of token ids")
        request.stop_token_ids.extend(_int32("stop_token_ids", token) for token in stop_ids)
    request.include_stop_str_in_output = _flag(body, "include_stop_str_in_output")


def _add_truncation(body: dict, request: serving_pb2.GenerateRequest) -> None:
    """vLLM's truncate_prompt_tokens and truncation_side ("left", its default, or "right")."""
    if body.get("truncate_prompt_tokens") is not None:
        request.truncate_prompt_tokens = _int32("truncate_prompt_tokens", body["truncate_prompt_tokens"])
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise FieldRefused("truncation_side", f'truncation_side must be "left" or "right" (got {side!r})')
    request.truncate_right = side == "right"


def add_messages(request, messages) -> None:
    """An OpenAI messages list onto a GenerateRequest's (or TokenizeRequest's) messages."""
    if not isinstance(messages, list) or not messages:
        raise FieldRefused("messages", "messages must be a non-empty list of messages")
    for index, message in enumerate(messages):
        _add_message(request, message, index)


def _add_message(request, message, index: int) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise FieldRefused(where, f"{where} must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str):
        raise FieldRefused(f"{where}.role", f"{where}.role must be a string")
    role = "system" if role == "developer" else role  # OpenAI's newer name for the system role
    added = request.messages.add(role=role)
    content = message.get("content")
    if content is None or isinstance(content, str):
        added.content = content or ""
    elif isinstance(content, list):
        for part_index, part in enumerate(content):
            _add_part(added, part, f"{where}.content[{part_index}]")
    else:
        raise FieldRefused(f"{where}.content", f"{where}.content must be a string or a list of parts")
    add_message_tools(added, message, where)


def _add_part(message: serving_pb2.ChatMessage, part, where: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in PART_TYPES:
        raise FieldRefused(f"{where}.type", f"{where}.type {kind!r} is not one of {', '.join(PART_TYPES)}")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise FieldRefused(f"{where}.text", f"{where}.text must be a string")
        message.parts.add(text=part["text"])
    elif kind == "input_audio":
        audio = part.get("input_audio") or {}
        data = audio.get("data", "") if isinstance(audio, dict) else ""
        kind_of = audio.get("format", "wav") if isinstance(audio, dict) else "wav"
        message.parts.add(media=serving_pb2.Media(mime_type=f"audio/{kind_of}", data=str(data).encode()))
    else:
        message.parts.add(media=_media(part, kind, where))


def _media(part: dict, kind: str, where: str) -> serving_pb2.Media:
    """An image_url or video_url part: a data URL's own type and bytes, else the URL itself (the
    media fetcher's to fetch where allowed_media_domains allows its host, else refused)."""
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise FieldRefused(f"{where}.{kind}", f"{where}.{kind}.url must be a string")
    fallback = "image/*" if kind == "image_url" else "video/*"
    if url.startswith("data:") and ";base64," in url:
        header, _, data = url.partition(";base64,")
        try:
            return serving_pb2.Media(mime_type=header[5:] or fallback, data=base64.b64decode(data))
        except (binascii.Error, ValueError):
            raise FieldRefused(f"{where}.{kind}", f"{where}.{kind}.url is not valid base64") from None
    return serving_pb2.Media(mime_type=fallback, url=url)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int32(name: str, value) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise FieldRefused(name, f"{name} must be an integer (got {value!r})")
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise FieldRefused(name, f"{name} is out of range (got {value})")
    return value


def _number(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise FieldRefused(name, f"{name} must be a number (got {value!r})")
    return float(value)  # NaN and infinities (which Python's JSON reads) fail validation's ranges


def _seed(value) -> int:
    if not _is_int(value):
        raise FieldRefused("seed", f"seed must be an integer (got {value!r})")
    if value < 0:  # the bracket: pydantic's error type, which vLLM's clients look for
        raise FieldRefused("seed", f"seed must be 0 or more (got {value}) [type=greater_than_equal]")
    if value > MAX_SEED:
        raise FieldRefused("seed", seed_too_large(value))
    return value


def _stop(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise FieldRefused("stop", "stop must be a string or a list of strings")


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    """A true/false field; the strings "true" and "false" read as their values, as vLLM's pydantic
    models read them (clients that build bodies from form values send them so)."""
    value = body.get(key)
    if value is None:
        return False
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise FieldRefused(name or key, f"{name or key} must be true or false (got {value!r})")
    return value

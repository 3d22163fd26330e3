"""Checks Generate and Tokenize requests before anything reaches the lane host.

This module owns the status code and the exact wording of every refusal of a bad request; the
wording is frozen in tests/golden/errors/. Checks that need the prompt's token count (the context)
run after tokenizing, through `max_tokens_for`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.server.media_checks import VISION_NEEDED, check_media
from tpserve.server.refusals import RequestRefused, invalid_argument

__all__ = ["VISION_NEEDED", "Limits", "RequestRefused", "invalid_argument"]

MAX_SEED = 2**63 - 1  # seeds travel between ranks as int64
TPSERVE_DEFAULTS = SamplingParams()  # greedy, no filters: an unset field's value without generation_config


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server."""

    context_size: int  # most tokens (prompt + reply) one stream may reach
    vocab_size: int
    room: int | None = None  # KV tokens the engine holds in all, when fewer than one context needs
    vision: bool = False
    # When max_tokens is unset (capped by what the context leaves); None: all the context leaves, as
    # vLLM (so a chat front end that sends no max_tokens gets whole replies).
    default_max_tokens: int | None = None
    max_temperature: float = 100.0
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_logprobs: int = 20  # likeliest alternatives reported per token
    max_images: int = 4  # image parts per request (with --vision)
    max_image_bytes: int = 10 << 20  # encoded bytes per image
    max_image_pixels: int = 4096 * 4096  # width x height per image, checked before decoding
    # Per video, checked before a frame is decoded (tpserve/server/videos.py).
    max_video_bytes: int = 10 << 20
    max_video_seconds: float = 120.0
    max_video_frames: int = 3600  # frames in the file, before sampling
    max_video_pixels: int = 1920 * 1080  # width x height per frame
    # The most UTF-8 bytes of prompt text that could fit the context (tpserve/server/prompt_size.py),
    # checked before tokenizing; None where the tokenizer allows no such bound.
    max_prompt_bytes: int | None = None


def _join_names(names: Sequence[str], last_word: str = "and") -> str:
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + f" {last_word} " + names[-1]


def _exactly_one(present: dict[str, bool]) -> str:
    """The one field of `present` that is set; refuses none or several."""
    names = list(present)
    chosen = [name for name, is_set in present.items() if is_set]
    if len(chosen) == 1:
        return chosen[0]
    got = "none" if not chosen else _join_names(chosen)
    raise invalid_argument(f"exactly one of {_join_names(names, 'or')} must be set (got {got})")


def prompt_kind(request) -> str:
    """Which input a GenerateRequest uses: "prompt", "messages" or "prompt_token_ids"."""
    kind = _exactly_one(
        {
            "prompt": request.HasField("prompt"),
            "messages": len(request.messages) > 0,
            "prompt_token_ids": len(request.prompt_token_ids) > 0,
        }
    )
    if kind == "prompt" and not request.prompt:
        raise invalid_argument("prompt is empty")
    return kind


def tokenize_kind(request) -> str:
    """Which input a TokenizeRequest uses: "text" or "messages"."""
    return _exactly_one({"text": request.HasField("text"), "messages": len(request.messages) > 0})


def check_messages(messages, limits: Limits) -> None:
    """Roles, and parts that are either text or image/video media (the latter only with --vision)."""
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        # Any role reaches the chat template, as transformers and vLLM pass it (custom roles are
        # the template's to render or refuse); only a missing one is refused here.
        if not message.role:
            raise invalid_argument(f"{where}.role is empty")
        if message.content and len(message.parts) > 0:
            raise invalid_argument(f"{where} sets both content and parts; use one")
        for part_index, part in enumerate(message.parts):
            part_where = f"{where}.parts[{part_index}]"
            kind = part.WhichOneof("kind")
            if kind is None:
                raise invalid_argument(f"{part_where} has neither text nor media")
            if kind == "media":
                check_media(part.media, part_where, limits)
    num_images = sum(part.HasField("media") for message in messages for part in message.parts)
    if num_images > limits.max_images:
        raise invalid_argument(
            f"at most {limits.max_images} images are allowed per request (got {num_images})"
        )


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str = "prompt_token_ids") -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise invalid_argument(
                f"{field}[{index}] = {token_id} is outside the vocabulary of {vocab_size} tokens"
            )


def check_prompt_size(texts: Sequence[str], what: str, limits: Limits) -> None:
    """Refuses prompt text that no tokenizing could fit into the context, before it is tokenized.
    `what` names it: "prompt", "text", "messages' text"."""
    limit = limits.max_prompt_bytes
    if limit is None or sum(len(text) for text in texts) * 4 <= limit:  # 4: UTF-8's widest character
        return
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    if size > limit:
        raise invalid_argument(
            f"{what} is {size} bytes long; no prompt over {limit} bytes can fit the context of "
            f"{limits.context_size} tokens"
        )


def message_texts(messages) -> list[str]:
    """Every piece of text in chat messages (roles, contents and text parts)."""
    texts = []
    for message in messages:
        texts += [message.role, message.content]
        texts += [part.text for part in message.parts if part.HasField("text")]
    return texts


def check_generate(request, limits: Limits) -> str:
    """Every check that needs no tokenizing; returns the prompt kind (see prompt_kind)."""
    kind = prompt_kind(request)
    if kind == "prompt":
        check_prompt_size([request.prompt], "prompt", limits)
    if kind == "messages":
        check_prompt_size(message_texts(request.messages), "messages' text", limits)
        check_messages(request.messages, limits)
    elif kind == "prompt_token_ids":
        check_token_ids(request.prompt_token_ids, limits.vocab_size)
    if request.HasField("max_tokens"):
        if request.max_tokens < 1:
            raise invalid_argument(f"max_tokens must be at least 1 (got {request.max_tokens})")
        if request.max_tokens > limits.context_size:
            raise invalid_argument(
                f"max_tokens ({request.max_tokens}) exceeds the context of {limits.context_size} tokens"
            )
    _check_sampling(request, limits)
    _check_adjustments(request, limits)
    _check_stop(request.stop, limits)
    check_token_ids(request.stop_token_ids, limits.vocab_size, "stop_token_ids")
    return kind


def _check_adjustments(request, limits: Limits) -> None:
    """The logit adjustments' ranges (OpenAI's for the penalties and logit_bias)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if request.HasField(name) and not -2.0 <= getattr(request, name) <= 2.0:
            raise invalid_argument(f"{name} must be from -2 to 2 (got {getattr(request, name):g})")
    if request.HasField("repetition_penalty") and not 0.0 < request.repetition_penalty <= 10.0:
        raise invalid_argument(
            f"repetition_penalty must be above 0 and at most 10 (got {request.repetition_penalty:g})"
        )
    for token_id, bias in sorted(request.logit_bias.items()):
        if not 0 <= token_id < limits.vocab_size:
            raise invalid_argument(
                f"logit_bias[{token_id}]: the token is outside the vocabulary of {limits.vocab_size} tokens"
            )
        if not -100.0 <= bias <= 100.0:
            raise invalid_argument(f"logit_bias[{token_id}] must be from -100 to 100 (got {bias:g})")
    if request.HasField("min_tokens") and request.min_tokens < 0:
        raise invalid_argument(f"min_tokens must be 0 or more (got {request.min_tokens})")


def _check_sampling(request, limits: Limits) -> None:
    # Written so that NaN fails every range check: comparisons with NaN are all False.
    if request.HasField("temperature") and not 0.0 <= request.temperature <= limits.max_temperature:
        raise invalid_argument(
            f"temperature must be from 0 to {limits.max_temperature:g} (got {request.temperature:g})"
        )
    if request.HasField("top_p") and not 0.0 < request.top_p <= 1.0:
        raise invalid_argument(f"top_p must be above 0 and at most 1 (got {request.top_p:g})")
    if request.HasField("top_k") and request.top_k < 0:
        raise invalid_argument(f"top_k must be 0 (off) or more (got {request.top_k})")
    if request.HasField("min_p") and not 0.0 <= request.min_p <= 1.0:
        raise invalid_argument(f"min_p must be from 0 to 1 (got {request.min_p:g})")
    if request.HasField("seed") and request.seed > MAX_SEED:
        raise invalid_argument(seed_too_large(request.seed))
    for name in ("logprobs", "prompt_logprobs"):
        if request.HasField(name):
            _check_logprobs_count(name, getattr(request, name), limits)
    if request.HasField("truncate_prompt_tokens") and not (
        request.truncate_prompt_tokens >= 1 or request.truncate_prompt_tokens == -1
    ):
        raise invalid_argument(
            f"truncate_prompt_tokens must be 1 or more, or -1 (got {request.truncate_prompt_tokens})"
        )


def seed_too_large(seed: int) -> str:
    """The refusal of a seed past int64, with pydantic's error type in brackets (vLLM's wording,
    which its clients and tests look for)."""
    return f"seed must be below 2**63 (got {seed}) [type=less_than_equal]"


def _check_logprobs_count(name: str, count: int, limits: Limits) -> None:
    """A count of likeliest tokens: 0 to max_logprobs, or -1 (vLLM's "the whole vocabulary") where
    max_logprobs allows that many (-1: no limit, as vLLM's --max-logprobs -1)."""
    limit = limits.vocab_size if limits.max_logprobs == -1 else limits.max_logprobs
    if count == -1 and limits.vocab_size > limit:
        raise invalid_argument(
            f"{name} -1 (the whole vocabulary of {limits.vocab_size} tokens) exceeds the server's "
            f"max_logprobs ({limit})"
        )
    if count != -1 and not 0 <= count <= limit:
        raise invalid_argument(f"{name} must be from 0 to {limit} (got {count})")


def logprobs_count(count: int, vocab_size: int) -> int:
    """A checked count of likeliest tokens as the engine takes it: -1 is the whole vocabulary."""
    return vocab_size if count == -1 else count


def _check_stop(stop: Sequence[str], limits: Limits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise invalid_argument(
            f"at most {limits.max_stop_strings} stop strings are allowed (got {len(stop)})"
        )
    for index, text in enumerate(stop):
        if not text:
            raise invalid_argument(f"stop[{index}] is empty")
        if len(text) > limits.max_stop_chars:
            raise invalid_argument(
                f"stop[{index}] is {len(text)} characters long; the most is {limits.max_stop_chars}"
            )


def sampling_from(
    request, fresh_seed: int, defaults: SamplingParams = TPSERVE_DEFAULTS, vocab_size: int = 0
) -> SamplingParams:
    """The request's sampling fields, `defaults` where unset (the model's generation_config.json, else
    tpserve's own), `fresh_seed` when no seed; logprobs -1 asks for all `vocab_size` tokens."""
    return SamplingParams(
        temperature=request.temperature if request.HasField("temperature") else defaults.temperature,
        top_p=request.top_p if request.HasField("top_p") else defaults.top_p,
        top_k=request.top_k if request.HasField("top_k") else defaults.top_k,
        min_p=request.min_p if request.HasField("min_p") else defaults.min_p,
        seed=request.seed if request.HasField("seed") else fresh_seed,
        logprobs=(
            logprobs_count(request.logprobs, vocab_size)
            if request.HasField("logprobs")
            else defaults.logprobs
        ),
        presence_penalty=request.presence_penalty if request.HasField("presence_penalty") else 0.0,
        frequency_penalty=request.frequency_penalty if request.HasField("frequency_penalty") else 0.0,
        repetition_penalty=(
            request.repetition_penalty
            if request.HasField("repetition_penalty")
            else defaults.repetition_penalty
        ),
        logit_bias=tuple(sorted(request.logit_bias.items())),
    )


def truncated(request, prompt_ids: list[int], limits: Limits) -> list[int]:
    """The prompt cut to truncate_prompt_tokens (-1: the context size), its first tokens dropped, or
    its last with truncate_right; the whole prompt when unset."""
    if not request.HasField("truncate_prompt_tokens"):
        return prompt_ids
    keep = limits.context_size if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
    if len(prompt_ids) <= keep:
        return prompt_ids
    return prompt_ids[:keep] if request.truncate_right else prompt_ids[len(prompt_ids) - keep :]


def max_tokens_for(request, num_prompt_tokens: int, limits: Limits) -> int:
    """The reply's token budget; refuses a prompt that, with it, does not fit the context."""
    context = limits.context_size
    if num_prompt_tokens == 0:
        raise invalid_argument("prompt has no tokens")
    if request.HasField("max_tokens"):
        if num_prompt_tokens + request.max_tokens > context:
            raise invalid_argument(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({request.max_tokens}) "
                f"exceeds the context of {context} tokens"
            )
        _check_room(num_prompt_tokens, request.max_tokens, limits)
        return request.max_tokens
    if num_prompt_tokens >= context:
        raise invalid_argument(
            f"prompt ({num_prompt_tokens} tokens) leaves no room to reply in the context of {context} tokens"
        )
    max_tokens = context - num_prompt_tokens
    if limits.default_max_tokens is not None:
        max_tokens = min(max_tokens, limits.default_max_tokens)
    if limits.room is not None:
        # An unset max_tokens shrinks to fit the engine rather than refusing a prompt that fits.
        max_tokens = min(max_tokens, max(1, limits.room - num_prompt_tokens))
    _check_room(num_prompt_tokens, max_tokens, limits)
    return max_tokens


def check_min_tokens(request, max_tokens: int) -> None:
    """min_tokens within the reply's budget, max_tokens set or not (vLLM refuses it too)."""
    if request.min_tokens > max_tokens:
        raise invalid_argument(f"min_tokens ({request.min_tokens}) exceeds max_tokens ({max_tokens})")


def _check_room(num_prompt_tokens: int, max_tokens: int, limits: Limits) -> None:
    if limits.room is not None and num_prompt_tokens + max_tokens > limits.room:
        raise invalid_argument(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs more KV room "
            f"than the engine holds ({limits.room} tokens)"
        )

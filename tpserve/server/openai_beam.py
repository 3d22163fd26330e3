"""vLLM's `use_beam_search` over the OpenAI API: which fields a beam search honours, and its answer.

A beam search answers each prompt with its `n` best beams (tpserve/server/beam_search.py), whole. It ranks
beams by the model's own log probabilities, so a field that would change what is sampled or how the
reply is sent is refused by name beside it (400) rather than ignored: sampling settings other than
temperature 0, penalties, biases, stops, grammars, tools, log probabilities, echo and streaming.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tpserve.server.beam_search import BeamResult
from tpserve.server.openai_fields import FIELDS, HONOURED, FieldRefused
from tpserve.server.openai_reply import ReplyShape
from tpserve.server.requests import LENGTH, STOP, Usage

# Honoured fields a beam search honours too (every field with no effect on the reply passes as well).
BEAM_FIELDS = {
    "messages",
    "prompt",
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "use_beam_search",
    "length_penalty",
    "ignore_eos",
    "temperature",  # 0 only (below)
    "seed",  # a search draws nothing: any seed gives the same beams
    "return_token_ids",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "truncate_prompt_tokens",
    "truncation_side",
    "skip_special_tokens",
}
ASKS_NOTHING = (None, False, [], {}, "")


@dataclass(frozen=True)
class BeamRequest:
    width: int  # beams per prompt: the request's n
    length_penalty: float


def beam_from(body: dict, n: int) -> BeamRequest | None:
    """The request's beam search, None without use_beam_search; refuses what a search cannot honour."""
    asked = body.get("use_beam_search")
    if asked is None or asked is False:
        if body.get("length_penalty") not in (None, 1, 1.0):
            raise FieldRefused("length_penalty", "length_penalty needs use_beam_search: true")
        return None
    if asked is not True:
        raise FieldRefused("use_beam_search", f"use_beam_search must be true or false (got {asked!r})")
    for name, value in body.items():
        honoured = name in FIELDS and FIELDS[name].handling == HONOURED
        if (
            honoured
            and name not in BEAM_FIELDS
            and not any(_same(value, nothing) for nothing in ASKS_NOTHING)
        ):
            raise FieldRefused(name, f"{name} is not supported with use_beam_search")
    if body.get("temperature") not in (None, 0, 0.0):
        raise FieldRefused(
            "temperature", "use_beam_search ranks the model's log probabilities: temperature must be 0"
        )
    penalty = body.get("length_penalty", 1.0)
    if penalty is None:
        penalty = 1.0
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not -10.0 <= penalty <= 10.0:
        raise FieldRefused(
            "length_penalty", f"length_penalty must be a number from -10 to 10 (got {penalty!r})"
        )
    return BeamRequest(width=n, length_penalty=float(penalty))


def beam_reply(shape: ReplyShape, results: list[BeamResult], decode: Callable[[list[int]], str]) -> dict:
    """The whole answer: prompt i's beams are choices i * n onwards, best first. A beam that ended
    on an end-of-sequence token finished with "stop" (the token in its token_ids, not its text)."""
    choices, num_prompt, num_reply = [], 0, 0
    for result in results:
        num_prompt += len(result.prompt_ids)
        for beam in result.beams:
            text_ids = beam.token_ids[:-1] if beam.ended else beam.token_ids
            reason = STOP if beam.ended else LENGTH
            choice = shape.choice(len(choices), decode(list(text_ids)), list(beam.token_ids), reason)
            if shape.return_token_ids and not shape.chat:
                choice["prompt_token_ids"] = list(result.prompt_ids)
            choices.append(choice)
            num_reply += len(beam.token_ids)
    usage = Usage(prompt_tokens=num_prompt, completion_tokens=num_reply, cached_tokens=0,
                  time_to_first_token_s=None, total_s=0.0)  # fmt: skip
    whole = shape.whole_of(choices, usage)
    if shape.return_token_ids and shape.chat:
        whole["prompt_token_ids"] = list(results[0].prompt_ids)
    return whole


def _same(value, nothing) -> bool:
    return type(value) is type(nothing) and value == nothing

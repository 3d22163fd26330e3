"""Every request field of /v1/chat/completions and /v1/completions this server knows, and what it does
with each: honoured, accepted without effect on the reply, or refused by name (400 with `param`).

Nothing is silently ignored. A field missing from the table is refused too (as OpenAI refuses an
unrecognized argument): this server cannot tell whether it would change the reply. A refused field
is accepted only with a value that asks for nothing (its `neutral` values; null always counts as
unset), so clients that send defaults explicitly still work.

The fields still marked OWNER_24G (guided decoding's backend options, structural tags, the old
function-calling fields, reasoning effort but for harmony templates, which read it before this
table) are refused until built; flipping one is a one-line change of its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tpserve.server.validation import RequestRefused

HONOURED = "honoured"
NO_EFFECT = "accepted, no effect on the reply"
REFUSED = "refused unless neutral"
CHAT, COMPLETION = "chat", "completion"
BOTH = (CHAT, COMPLETION)
OWNER_24G = "issue-24g"  # structured outputs, tools and reasoning: built on that branch
PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}


class FieldRefused(RequestRefused):
    """A bad field of an OpenAI body: INVALID_ARGUMENT, and the field's name (the error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.param = param


@dataclass(frozen=True)
class Field:
    handling: str
    apis: tuple[str, ...] = BOTH
    neutral: tuple = ()  # for REFUSED: the values accepted because they ask for nothing
    owner: str = ""


def _honoured(apis: tuple[str, ...] = BOTH) -> Field:
    return Field(HONOURED, apis)


def _no_effect(apis: tuple[str, ...] = BOTH) -> Field:
    return Field(NO_EFFECT, apis)


def _refused(*neutral, apis: tuple[str, ...] = BOTH, owner: str = "") -> Field:
    return Field(REFUSED, apis, neutral, owner)


FIELDS: dict[str, Field] = {
    # --- the prompt, the model, how the reply is sent ---
    "messages": _honoured((CHAT,)),
    "prompt": _honoured((COMPLETION,)),
    "model": _honoured(),
    "stream": _honoured(),
    "stream_options": _honoured(),
    "return_token_ids": _honoured(),  # vLLM: each choice's token ids
    # --- length and sampling ---
    "max_tokens": _honoured(),
    "max_completion_tokens": _honoured((CHAT,)),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "top_k": _honoured(),  # vLLM
    "min_p": _honoured(),  # vLLM
    "seed": _honoured(),
    "stop": _honoured(),
    "ignore_eos": _honoured(),  # vLLM
    "logprobs": _honoured(),
    "top_logprobs": _honoured((CHAT,)),
    "frequency_penalty": _honoured(),
    "presence_penalty": _honoured(),
    "repetition_penalty": _honoured(),  # vLLM
    "logit_bias": _honoured(),
    "min_tokens": _honoured(),  # vLLM
    "stop_token_ids": _honoured(),  # vLLM
    "include_stop_str_in_output": _honoured(),  # vLLM
    "skip_special_tokens": _honoured(),  # vLLM
    "n": _honoured(),
    "best_of": _refused(1, apis=(COMPLETION,)),
    "echo": _honoured((COMPLETION,)),  # with logprobs: the prompt's tokens' log probabilities too
    "suffix": _refused("", apis=(COMPLETION,)),
    "prompt_logprobs": _honoured(),  # vLLM
    "allowed_token_ids": _refused(),  # vLLM
    "bad_words": _refused([]),  # vLLM
    "use_beam_search": _honoured(),  # vLLM: tpserve/server/openai_beam.py
    "length_penalty": _honoured(),  # vLLM, beam search only
    # vLLM: a fast tokenizer's decoder joins special tokens as it joins any (vLLM's fast
    # detokenizer ignores the field too), so false changes nothing either.
    "spaces_between_special_tokens": _no_effect(),
    "truncate_prompt_tokens": _honoured(),  # vLLM: the prompt's last N tokens run
    "truncation_side": _honoured(),  # vLLM: "right" keeps the first N instead
    "logits_processors": _refused([]),  # vLLM
    "return_tokens_as_token_ids": _refused(False),  # vLLM
    "add_special_tokens": _refused(),  # vLLM: this server tokenizes as the model's tokenizer does
    "prompt_embeds": _refused(apis=(COMPLETION,)),  # vLLM
    "priority": _refused(0),  # vLLM: this server schedules first come, first served
    "cache_salt": _refused(),  # vLLM: the prompt cache is shared, never salted
    "kv_transfer_params": _refused(),  # vLLM
    "vllm_xargs": _refused(),  # vLLM
    # --- chat only ---
    "add_generation_prompt": _honoured((CHAT,)),  # vLLM
    "continue_final_message": _honoured((CHAT,)),  # vLLM: the reply continues the last message
    "chat_template": _refused(apis=(CHAT,)),  # vLLM
    "documents": _refused(apis=(CHAT,)),  # vLLM
    "mm_processor_kwargs": _refused(apis=(CHAT,)),  # vLLM
    "modalities": _refused(["text"], apis=(CHAT,)),
    "audio": _refused(apis=(CHAT,)),
    "prediction": _refused(apis=(CHAT,)),
    "web_search_options": _refused(apis=(CHAT,)),
    "verbosity": _refused(apis=(CHAT,)),
    # --- structured outputs, tools, reasoning: refused until issue-24g builds them ---
    "response_format": _honoured(),  # tpserve/server/openai_constraint.py
    "structured_outputs": _honoured(),  # vLLM
    "guided_json": _honoured(),  # vLLM (older name)
    "guided_regex": _honoured(),
    "guided_choice": _honoured(),
    "guided_grammar": _honoured(),
    "guided_decoding_backend": _refused(owner=OWNER_24G),
    "guided_whitespace_pattern": _refused(owner=OWNER_24G),
    "structural_tag": _refused(owner=OWNER_24G),
    "tools": _honoured((CHAT,)),  # tpserve/server/openai_tools.py
    "tool_choice": _honoured((CHAT,)),
    "parallel_tool_calls": _honoured((CHAT,)),
    "functions": _refused([], apis=(CHAT,), owner=OWNER_24G),
    "function_call": _refused("none", "auto", apis=(CHAT,), owner=OWNER_24G),
    "chat_template_kwargs": _honoured((CHAT,)),  # vLLM
    # honoured for harmony models (gpt-oss: its template reads it, tpserve/server/harmony_requests.py)
    "reasoning_effort": _refused(apis=(CHAT,), owner=OWNER_24G),
    "include_reasoning": _honoured((CHAT,)),  # vLLM: false drops reasoning_content
    # --- bookkeeping: accepted, never changes the reply ---
    "user": _no_effect(),
    "metadata": _no_effect(),
    "store": _no_effect(),
    "service_tier": _no_effect(),
    "request_id": _no_effect(),  # vLLM
    "prompt_cache_key": _no_effect(),  # the prompt cache matches prefixes itself
    "safety_identifier": _no_effect(),
}


# A name whose meaning differs on chat: vLLM's chat echo repeats the last message.
CHAT_FIELDS: dict[str, Field] = {"echo": _honoured((CHAT,))}


def check_fields(body: dict, api: str) -> None:
    """Refuse, naming it, the first field of `body` this server would otherwise ignore."""
    for name, value in body.items():
        field = (CHAT_FIELDS.get(name) if api == CHAT else None) or FIELDS.get(name)
        if field is None or api not in field.apis:
            raise FieldRefused(name, f"{name} is not a field of {PATHS[api]} this server knows")
        asks_nothing = value is None or any(_same(value, neutral) for neutral in field.neutral)
        if field.handling == REFUSED and not asks_nothing:
            raise FieldRefused(name, f"{name} is not supported by this server")


def _same(value, neutral) -> bool:
    return type(value) is type(neutral) and value == neutral

"""vLLM's tokenizer routes on the HTTP API: POST /tokenize, POST /detokenize, GET /tokenizer_info
and GET /version.

The request and reply shapes are vLLM's (`prompt` or `messages` in, `count`, `max_model_len` and
`tokens` out; `tokens` in, `prompt` out), so its clients and tests read them; the checks and their
wording are gRPC's Tokenize ones (a TokenizeRequest is built and run by the same Submitter).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tpserve.ranks.version import VERSION
from tpserve.server.openai_fields import FieldRefused
from tpserve.server.openai_request import add_messages
from tpserve.server.submitter import Submitter
from tpserve.server.validation import check_token_ids
from tpserve.v1 import serving_pb2

TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt")
TOKENIZE_FIELDS += ("continue_final_message", "tools", "chat_template_kwargs", "return_token_strs")
DETOKENIZE_FIELDS = ("model", "tokens")


def tokenize_reply(
    submitter: Submitter, body: dict, fill_media: Callable[[list], None] | None = None
) -> dict:
    """fill_media: replaces the messages' media URLs by their bytes (the HTTP API's fetcher, where
    allowed_media_domains allows some), as a chat's are before it is queued."""
    _known(body, TOKENIZE_FIELDS, "/tokenize")
    request = serving_pb2.TokenizeRequest()
    if body.get("prompt") is not None:
        if not isinstance(body["prompt"], str):
            raise FieldRefused("prompt", "prompt must be a string")
        request.text = body["prompt"]
    if body.get("messages") is not None:
        add_messages(request, body["messages"])
        if fill_media is not None:
            fill_media([request])
    for name in ("add_special_tokens", "add_generation_prompt", "continue_final_message"):
        if body.get(name) is not None:
            if not isinstance(body[name], bool):
                raise FieldRefused(name, f"{name} must be true or false")
            setattr(request, name, body[name])
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise FieldRefused("tools", "tools must be a list of tools")
        request.tools_json = json.dumps(body["tools"])
    if body.get("chat_template_kwargs") is not None:
        if not isinstance(body["chat_template_kwargs"], dict):
            raise FieldRefused("chat_template_kwargs", "chat_template_kwargs must be an object")
        request.chat_template_kwargs_json = json.dumps(body["chat_template_kwargs"])
    token_ids = submitter.tokenize(request)
    reply = {"count": len(token_ids), "max_model_len": submitter.info.context_size, "tokens": token_ids}
    strs = body.get("return_token_strs")
    if strs is not None and not isinstance(strs, bool):
        raise FieldRefused("return_token_strs", "return_token_strs must be true or false")
    # Each token as the vocabulary spells it (transformers' convert_ids_to_tokens, as vLLM's).
    reply["token_strs"] = [submitter.tokenizer.token_text(t) for t in token_ids] if strs else None
    return reply


def detokenize_reply(submitter: Submitter, body: dict) -> dict:
    _known(body, DETOKENIZE_FIELDS, "/detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise FieldRefused("tokens", "tokens must be a list of token ids")
    check_token_ids(tokens, submitter.tokenizer.vocab_size, "tokens")
    return {"prompt": submitter.tokenizer.decode(tokens)}


def tokenizer_info_reply(submitter: Submitter) -> dict:
    """vLLM's GET /tokenizer_info: what a client needs to tokenize as this server does (the class
    transformers loads a tokenizer.json with, the special tokens, the chat template, the context)."""
    tokenizer = submitter.tokenizer
    info = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tokenizer.add_bos}
    info.update(tokenizer.special_tokens)
    info["model_max_length"] = submitter.info.context_size
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def version_reply() -> dict:
    return {"version": VERSION}


def _known(body: dict, names: tuple[str, ...], path: str) -> None:
    for name in body:
        if name not in names:
            raise FieldRefused(name, f"{name} is not a field of {path} this server knows")

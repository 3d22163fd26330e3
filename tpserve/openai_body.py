"""A tpserve.v1 GenerateRequest as the OpenAI HTTP request that asks the same: the path under /v1 and
the JSON body. `tpserve bench --openai-url` sends its prompts this way, to tpserve or any other
OpenAI-compatible server; the reverse of the server's own translation (tpserve/server/openai_request.py).
"""

from __future__ import annotations

import base64
import json

from tpserve.v1 import serving_pb2

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")
SAMPLING_FIELDS += ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")


def openai_body(request: serving_pb2.GenerateRequest, model: str | None = None) -> tuple[str, dict] | None:
    """("completions" or "chat/completions", body); None where the OpenAI shape cannot say the
    request (two inputs at once, a message with both content and parts, a part with neither)."""
    kinds = [request.HasField("prompt"), len(request.messages) > 0, len(request.prompt_token_ids) > 0]
    if sum(kinds) != 1:
        return None
    body: dict = {} if model is None else {"model": model}
    if request.HasField("prompt"):
        path, body["prompt"] = "completions", request.prompt
    elif request.prompt_token_ids:
        path, body["prompt"] = "completions", list(request.prompt_token_ids)
    else:
        path, body["messages"] = "chat/completions", []
        for message in request.messages:
            if message.content and message.parts:
                return None
            content: str | list = message.content
            if message.parts:
                if any(part.WhichOneof("kind") is None for part in message.parts):
                    return None
                content = [_part(part) for part in message.parts]
            body["messages"].append({"role": message.role, "content": content})
    for name in SAMPLING_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.HasField("logprobs"):
        if path == "completions":
            body["logprobs"] = request.logprobs
        else:
            body["logprobs"], body["top_logprobs"] = True, request.logprobs
    if request.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in request.logit_bias.items()}
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.include_stop_str_in_output:
        body["include_stop_str_in_output"] = True
    if request.ignore_eos:
        body["ignore_eos"] = True  # an extension vLLM, llama.cpp's server and tpserve all read
    if request.HasField("constraint"):
        body["structured_outputs"] = _structured_outputs(request.constraint)
    for field, key in (("tools_json", "tools"), ("chat_template_kwargs_json", "chat_template_kwargs")):
        if getattr(request, field):
            try:
                body[key] = json.loads(getattr(request, field))
            except json.JSONDecodeError:
                return None  # JSON in name only: an OpenAI body cannot carry it
    return path, body


def _structured_outputs(constraint: serving_pb2.Constraint) -> dict:
    """vLLM's spelling of a constraint (the json schema as its text, which vLLM reads too)."""
    kind = constraint.WhichOneof("kind")
    if kind == "json_schema":
        return {"json": constraint.json_schema}
    if kind == "choice":
        return {"choice": list(constraint.choice.choices)}
    return {kind: getattr(constraint, kind)} if kind else {}


def _part(part: serving_pb2.ContentPart) -> dict:
    if part.HasField("text"):
        return {"type": "text", "text": part.text}
    kind = "image_url" if part.media.mime_type.startswith("image/") else "video_url"
    if part.media.HasField("url"):
        return {"type": kind, kind: {"url": part.media.url}}
    url = f"data:{part.media.mime_type};base64,{base64.b64encode(part.media.data).decode()}"
    return {"type": kind, kind: {"url": url}}

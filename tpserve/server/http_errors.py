"""Refusals as OpenAI error objects with the HTTP status a client expects for each gRPC status code.

The message is the gRPC one word for word (tests/golden/errors/); `param` names the field when
the refusal names one.
"""

from __future__ import annotations

import re

import grpc
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from tpserve.server.api_key import UNAUTHENTICATED
from tpserve.server.openai_fields import FieldRefused
from tpserve.server.validation import RequestRefused

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}
# The request fields validation's messages begin with ("max_tokens must be ...", "messages[0].role ...").
FIELDS = ("prompt_token_ids", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p")
FIELDS += ("seed", "stop", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty")
FIELDS += ("logit_bias", "min_tokens", "stop_token_ids", "prompt_logprobs")
_LEADING_FIELD = re.compile(r"^([a-z_]+)((?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*)")


def status_of(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def param_of(message: str) -> str | None:
    """The field a refusal's message names first, as OpenAI's `param` (None when it names none)."""
    match = _LEADING_FIELD.match(message)
    if match is None or match.group(1) not in FIELDS:
        return None
    return match.group(1) + match.group(2)


def error_json(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


class HttpRefusal(Exception):
    """A request refused before it reaches the Submitter: an HTTP status and the message."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def refusal_response(refusal: HttpRefusal | RequestRefused) -> JSONResponse:
    if isinstance(refusal, HttpRefusal):
        body = error_json(refusal.status, refusal.message, param=refusal.param, code=refusal.code)
        return JSONResponse(body, status_code=refusal.status)
    status = status_of(refusal.code)
    param = refusal.param if isinstance(refusal, FieldRefused) else param_of(refusal.message)
    body = error_json(status, refusal.message, param=param, code=refusal.code.name.lower())
    return JSONResponse(body, status_code=status)


def unauthorized_response() -> JSONResponse:
    body = error_json(401, UNAUTHENTICATED, code="invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


async def http_exception(request: Request, error: HTTPException) -> JSONResponse:
    """Unknown paths (404) and methods (405) answer as OpenAI errors too."""
    message = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path}",
    }
    body = error_json(error.status_code, message.get(error.status_code, str(error.detail)))
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)

"""The optional API key both APIs check: `authorization: Bearer KEY`, compared in constant time.

With a key set, gRPC calls need it as metadata and HTTP requests as a header (HTTP's /metrics
too); health stays open on both, so a supervisor or load balancer needs no secret. A missing or
wrong key, or more than one authorization header (which a proxy and a client may each have added:
neither first- nor last-wins is safe), gets UNAUTHENTICATED (gRPC) or 401 (HTTP) with one fixed
message that tells nothing about the key. A configured key with surrounding whitespace or a
control character is refused at start-up (clients' values are stripped, so it could never match).
"""

from __future__ import annotations

import hmac
import unicodedata
from collections.abc import Callable, Sequence

import grpc

API_KEY_ENV = "TPSERVE_API_KEY"  # where the daemon, the client and the bench also look for the key
UNAUTHENTICATED = "missing or wrong API key (send the header authorization: Bearer KEY)"
OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"  # health checks need no key
BEARER = "bearer "


def key_problem(api_key: str) -> str | None:
    """What makes a configured key one no client could send (None: nothing); never shows the key."""
    if api_key != api_key.strip():
        return "it begins or ends with whitespace, which no client's header can carry; remove it"
    if any(unicodedata.category(char).startswith("C") for char in api_key):
        return "it holds a control or unprintable character, which no header can carry"
    return None


def key_matches(authorizations: Sequence[str], api_key: str) -> bool:
    """Whether the `authorization` header values (all of them) carry `api_key`: exactly one, the
    right one (always True when no key is set)."""
    if not api_key:
        return True
    if len(authorizations) != 1:
        return False
    authorization = authorizations[0]
    if authorization[: len(BEARER)].lower() != BEARER:
        return False
    given = authorization[len(BEARER) :].strip().encode()
    return hmac.compare_digest(given, api_key.encode())


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health whose metadata lacks the key, before its handler runs."""

    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("ApiKeyInterceptor needs a key")
        self._api_key = api_key

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_GRPC_PREFIX):
            return handler
        authorizations = [
            value if isinstance(value, str) else value.decode(errors="replace")
            for key, value in handler_call_details.invocation_metadata or ()
            if key == "authorization"
        ]
        if key_matches(authorizations, self._api_key):
            return handler
        return _refusing(handler)


def _refuse(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (streaming or not) that refuses the call."""
    options = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, **options)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **options)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **options)
    return grpc.unary_unary_rpc_method_handler(_refuse, **options)

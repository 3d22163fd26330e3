"""The optional API key both APIs check: `authorization: Bearer KEY`, compared in constant time.

With a key set, gRPC calls need it as metadata and HTTP requests as a header; health stays open on
both, so a supervisor or load balancer needs no secret. A missing or wrong key gets UNAUTHENTICATED
(gRPC) or 401 (HTTP) with one fixed message that tells nothing about the key.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import grpc

API_KEY_ENV = "TPSERVE_API_KEY"  # where the daemon, the client and the bench also look for the key
UNAUTHENTICATED = "missing or wrong API key (send the header authorization: Bearer KEY)"
OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"  # health checks need no key
BEARER = "bearer "


def key_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `authorization` header value carries `api_key` (always True when no key is set)."""
    if not api_key:
        return True
    if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
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
        authorization = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode(errors="replace")
        if key_matches(authorization, self._api_key):
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

"""What every gRPC call passes before its handler runs: a request that decodes, and a free place.

grpc's own answers to both reach clients in words no golden file freezes: a message that does not
decode is INTERNAL "Exception deserializing request!" (with a traceback in the log per call), and
a call past `maximum_concurrent_rpcs` is RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!".
Here a request that does not decode gets INVALID_ARGUMENT naming the message type, and the server
sets no grpc limit of its own: this interceptor refuses a call once `max_running` handlers run (a
long Watch or an unread stream holds one), with the lane host's queue-full wording, so a client
sees one refusal for every overload whichever layer turns it away. The pool keeps threads beyond
`max_running` so that those refusals never wait behind running calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

NOT_DECODABLE = "the request is not a valid {type} message ({reason})"


class Undecodable:
    """What the tolerant deserializer returns for bytes that are no message of the expected type."""

    def __init__(self, message: str):
        self.message = message


class CallGuard(grpc.ServerInterceptor):
    def __init__(self, max_running: int, overloaded: str):
        self._max_running = max_running
        self._overloaded = overloaded  # the message a refused call gets (the queue-full wording)
        self._lock = threading.Lock()
        self.num_running = 0

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        options = {
            "request_deserializer": _tolerant(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.request_streaming and handler.response_streaming:
            behavior = self._streaming(handler.stream_stream, requests_stream=True)
            return grpc.stream_stream_rpc_method_handler(behavior, **options)
        if handler.request_streaming:
            behavior = self._whole(handler.stream_unary, requests_stream=True)
            return grpc.stream_unary_rpc_method_handler(behavior, **options)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._streaming(handler.unary_stream), **options)
        return grpc.unary_unary_rpc_method_handler(self._whole(handler.unary_unary), **options)

    def _enter(self, context) -> None:
        with self._lock:
            if self.num_running < self._max_running:
                self.num_running += 1
                return
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._overloaded)

    def _leave(self) -> None:
        with self._lock:
            self.num_running -= 1

    def _whole(self, behavior: Callable, requests_stream: bool = False) -> Callable:
        def guarded(request, context):
            request = _checked(request, context, requests_stream)
            self._enter(context)
            try:
                return behavior(request, context)
            finally:
                self._leave()

        return guarded

    def _streaming(self, behavior: Callable, requests_stream: bool = False) -> Callable:
        def guarded(request, context) -> Iterator:
            request = _checked(request, context, requests_stream)
            self._enter(context)
            try:
                yield from behavior(request, context)
            finally:
                self._leave()

        return guarded


def _tolerant(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as error:
            owner = getattr(deserializer, "__self__", None)
            name = owner.DESCRIPTOR.full_name if hasattr(owner, "DESCRIPTOR") else "request"
            reason = str(error).rpartition("': ")[2] or type(error).__name__  # protobuf names the type
            return Undecodable(NOT_DECODABLE.format(type=name, reason=reason))

    return deserialize


def _checked(request, context, requests_stream: bool):
    if requests_stream:
        return _checked_each(request, context)
    if isinstance(request, Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    return request


def _checked_each(requests: Iterator, context) -> Iterator:
    for request in requests:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a server call now with this status, from any thread: for a call whose own thread is stuck
    in a send to a client that stopped reading. grpc's public cancel() ends it CANCELLED with no
    words; its call object cancels with a status (the client reads it after what it has buffered)."""
    context._rpc_event.call.cancel(_CYGRPC_CODES[code], details)


_CYGRPC_CODES = {code: code.value[0] for code in grpc.StatusCode}

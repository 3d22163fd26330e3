"""The gRPC Serving servicer: translates between the tpserve.v1 protos and the lane host.

It validates (server/validation.py), tokenizes, submits a GenerationRequest and relays the stream's
events as GenerateResponse messages. A client that cancels, disconnects or runs past its deadline
cancels its stream, so its lane is freed at the host's next boundary. A stream ended by a broken
engine fails with UNAVAILABLE (a stream's own error ends with finish reason ERROR instead).
Nothing is decided here.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from tpserve import __version__
from tpserve.ranks.errors import UserError
from tpserve.server.lane_host import LaneHost
from tpserve.server.lane_stream import Stream
from tpserve.server.metrics import ServingMetrics
from tpserve.server.requests import (
    CANCELLED,
    ERROR,
    LENGTH,
    STOP,
    Finished,
    GenerationRequest,
    HostUnavailable,
    Prefilled,
    QueueFull,
    TokenDelta,
)
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.validation import (
    Limits,
    RequestRefused,
    check_generate,
    check_messages,
    max_tokens_for,
    sampling_from,
    tokenize_kind,
)
from tpserve.v1 import serving_pb2, serving_pb2_grpc

log = logging.getLogger(__name__)

QUEUE_FULL = "the queue is full; try again later"
ENGINE_BROKEN = "the engine is broken; the server must be restarted"
ENGINE_BROKE_MID_REPLY = "the engine broke during this reply; the server must be restarted"
STOPPING = "the server is stopping"
NO_MEDIA_MODEL = "this server's model reads no image or video inputs"

FINISH_REASONS = {
    STOP: serving_pb2.FINISH_REASON_STOP,
    LENGTH: serving_pb2.FINISH_REASON_LENGTH,
    CANCELLED: serving_pb2.FINISH_REASON_CANCELLED,
    ERROR: serving_pb2.FINISH_REASON_ERROR,
}


@dataclass(frozen=True)
class ServingInfo:
    """What Info reports and what requests are checked against (besides the tokenizer's vocabulary)."""

    model_name: str
    tp_size: int
    num_lanes: int
    context_size: int
    room: int
    vision: bool = False
    default_max_tokens: int = 256


class ServingServicer(serving_pb2_grpc.ServingServicer):
    def __init__(
        self,
        lane_host: LaneHost,
        tokenizer: Tokenizer,
        info: ServingInfo,
        metrics: ServingMetrics | None = None,
        *,
        poll_s: float = 0.25,
        cancel_grace_s: float = 10.0,
    ):
        self._lane_host = lane_host
        self._tokenizer = tokenizer
        self._info = info
        self._metrics = metrics if metrics is not None else ServingMetrics()
        self._limits = Limits(
            context_size=info.context_size,
            vocab_size=tokenizer.vocab_size,
            room=info.room if info.room < info.context_size else None,
            vision=info.vision,
            default_max_tokens=info.default_max_tokens,
        )
        self._poll_s = poll_s  # how often a quiet stream looks at whether its client is still there
        self._cancel_grace_s = cancel_grace_s  # how long a cancelled stream waits for its Finished
        self._stopping = False

    def begin_stopping(self) -> None:
        """From now on every new Generate is refused with UNAVAILABLE."""
        self._stopping = True

    # --- Generate -------------------------------------------------------------------------------

    def Generate(self, request, context) -> Iterator[serving_pb2.GenerateResponse]:
        try:
            stream = self._submit(request)
        except RequestRefused as refusal:
            self._metrics.count_outcome(refusal.code.name.lower())
            context.abort(refusal.code, refusal.message)
        # add_callback runs on cancellation, disconnection and deadline alike; False means the RPC
        # already ended before we got here.
        if not context.add_callback(stream.cancel):
            stream.cancel()
        yield from self._relay(stream, context)

    def _submit(self, request) -> Stream:
        # A broken engine is the news a client can act on (the server needs a restart), so it
        # comes first, also while the broken daemon is on its way out.
        if self._lane_host.broken:
            raise RequestRefused(grpc.StatusCode.UNAVAILABLE, ENGINE_BROKEN)
        if self._stopping:
            raise RequestRefused(grpc.StatusCode.UNAVAILABLE, STOPPING)
        kind = check_generate(request, self._limits)
        boundaries: tuple[int, ...] = ()
        if kind == "prompt":
            prompt_ids = self._tokenizer.encode(request.prompt)
        elif kind == "messages":
            prompt_ids = self._encode_chat(request.messages)
            boundaries = self._chat_boundaries(request.messages, prompt_ids)
        else:
            prompt_ids = list(request.prompt_token_ids)
        job = GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens_for(request, len(prompt_ids), self._limits),
            sampling=sampling_from(request, fresh_seed=secrets.randbits(63)),
            stop=tuple(request.stop),
            ignore_eos=request.ignore_eos,
            background=request.background,
            keep_boundaries=boundaries,
        )
        try:
            return self._lane_host.submit(job)
        except QueueFull as error:
            raise RequestRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, QUEUE_FULL) from error
        except HostUnavailable as error:
            message = ENGINE_BROKEN if self._lane_host.broken else STOPPING
            raise RequestRefused(grpc.StatusCode.UNAVAILABLE, message) from error
        except ValueError as error:
            # The host's own checks; validation refuses all of these first unless the limits given
            # to this servicer disagree with the backend's.
            raise RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error

    def _relay(self, stream: Stream, context) -> Iterator[serving_pb2.GenerateResponse]:
        finished: Finished | None = None
        last_delta_at: float | None = None  # the first token's wait is time to first token, not this
        give_up_at: float | None = None
        try:
            while finished is None:
                events = _merge_deltas(stream.next_events(timeout=self._poll_s))
                if not events:
                    if not context.is_active():
                        stream.cancel()
                        give_up_at = give_up_at or time.monotonic() + self._cancel_grace_s
                        if time.monotonic() > give_up_at:
                            log.warning("a cancelled stream sent no Finished in %.1f s", self._cancel_grace_s)
                            return
                    continue
                for event in events:
                    response = self._response(event, context)
                    if isinstance(event, TokenDelta):
                        now = time.monotonic()
                        if event.token_ids and last_delta_at is not None:
                            self._metrics.inter_token.observe((now - last_delta_at) / len(event.token_ids))
                        last_delta_at = now
                    elif isinstance(event, Finished):
                        finished = event
                    yield response
        finally:
            if finished is None:
                # The client went away before the host's Finished reached it.
                stream.cancel()
                self._metrics.count_outcome(CANCELLED)

    def _response(self, event, context) -> serving_pb2.GenerateResponse:
        if isinstance(event, Prefilled):
            return serving_pb2.GenerateResponse(prefilled=True, cached_tokens=event.cached_tokens)
        if isinstance(event, TokenDelta):
            return serving_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text)
        if event.reason == ERROR and self._lane_host.broken:
            # Not this request's fault: the whole server is down, so the call fails the way
            # unreachable servers fail (clients retry UNAVAILABLE elsewhere).
            self._metrics.count_outcome(grpc.StatusCode.UNAVAILABLE.name.lower())
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{ENGINE_BROKE_MID_REPLY} ({event.error})")
        self._count_finished(event)
        return _final_response(event)

    def _count_finished(self, event: Finished) -> None:
        usage = event.usage
        self._metrics.count_outcome(event.reason)
        self._metrics.count_usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        if usage.time_to_first_token_s is not None:
            self._metrics.time_to_first_token.observe(usage.time_to_first_token_s)

    # --- Tokenize and Info ----------------------------------------------------------------------

    def Tokenize(self, request, context) -> serving_pb2.TokenizeResponse:
        try:
            if tokenize_kind(request) == "text":
                token_ids = self._tokenizer.encode(request.text)
            else:
                check_messages(request.messages, self._limits)
                token_ids = self._encode_chat(request.messages)
        except RequestRefused as refusal:
            context.abort(refusal.code, refusal.message)
        return serving_pb2.TokenizeResponse(token_ids=token_ids, num_tokens=len(token_ids))

    def Info(self, request, context) -> serving_pb2.InfoResponse:
        info = self._info
        return serving_pb2.InfoResponse(
            model_name=info.model_name,
            tp_size=info.tp_size,
            num_lanes=info.num_lanes,
            context_size=info.context_size,
            room=info.room,
            version=__version__,
            vocab_size=self._tokenizer.vocab_size,
            vision=info.vision,
            default_max_tokens=info.default_max_tokens,
        )

    def _chat_boundaries(self, messages, prompt_ids: list[int]) -> tuple[int, ...]:
        """Where later chats are likely to share this one's prefix: the end of a leading system
        message, and the start of the last message (the history before it). Offsets only where the
        template renders that part of the chat as a prefix of the whole."""
        cuts = {len(messages) - 1}
        if messages[0].role == "system":
            cuts.add(1)
        boundaries = []
        for cut in sorted(c for c in cuts if 0 < c < len(messages)):
            try:
                head = self._encode_chat(messages[:cut], add_generation_prompt=False)
            except RequestRefused:
                continue
            if head and prompt_ids[: len(head)] == head:
                boundaries.append(len(head))
        return tuple(boundaries)

    def _encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """Checked messages -> token ids through the model's chat template."""
        chat = []
        for message in messages:
            if any(part.HasField("media") for part in message.parts):
                # Validation let media through (--vision), but no model here reads it yet.
                raise RequestRefused(grpc.StatusCode.UNIMPLEMENTED, NO_MEDIA_MODEL)
            content = "".join(part.text for part in message.parts) if message.parts else message.content
            chat.append({"role": message.role, "content": content})
        try:
            return self._tokenizer.encode_chat(chat, add_generation_prompt=add_generation_prompt)
        except UserError as error:  # the template refused the conversation, or there is none
            raise RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error


def _final_response(event: Finished) -> serving_pb2.GenerateResponse:
    usage = event.usage
    return serving_pb2.GenerateResponse(
        finish_reason=FINISH_REASONS[event.reason],
        usage=serving_pb2.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            time_to_first_token_s=usage.time_to_first_token_s,
            total_s=usage.total_s,
        ),
        error=event.error or "",
    )


def _merge_deltas(events: list) -> list:
    """Consecutive token deltas as one: the tokens a round released reach the client in one message."""
    merged: list = []
    for event in events:
        if isinstance(event, TokenDelta) and merged and isinstance(merged[-1], TokenDelta):
            previous = merged[-1]
            event = TokenDelta(previous.token_ids + event.token_ids, previous.text + event.text)
            merged[-1] = event
        else:
            merged.append(event)
    return merged

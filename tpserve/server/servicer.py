"""The gRPC Serving servicer: translates between the tpserve.v1 protos and the lane host.

Checking, tokenizing and submitting belong to the Submitter (tpserve/server/submitter.py), which the HTTP
API shares; this relays the stream's events as GenerateResponse messages. A client that cancels,
disconnects or runs past its deadline cancels its stream, so its lane is freed at the host's next
boundary. A client that stops reading blocks its call's sends once the connection's buffers fill;
past max_unread_tokens more its stream cancels itself and the call ends RESOURCE_EXHAUSTED at once,
from the thread that put the token (the call's own thread is stuck in the send), freeing it. A stream ended by a broken engine fails with UNAVAILABLE (a stream's own error ends with
finish reason ERROR instead). Media URLs go to the fetcher the HTTP API uses, on the call's own
thread before the request goes further (allowed_media_domains; without it the media checks refuse
them). Nothing is decided here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc

from tpserve.ranks.version import VERSION
from tpserve.server.grpc_calls import end_call
from tpserve.server.lane_stream import Stream, merge_deltas
from tpserve.server.media_fetch import MediaFetcher
from tpserve.server.requests import CANCELLED, ERROR, LENGTH, STOP, Finished, Prefilled, TokenDelta
from tpserve.server.serving_info import ServingInfo
from tpserve.server.submitter import Submitter
from tpserve.server.validation import RequestRefused
from tpserve.v1 import serving_pb2, serving_pb2_grpc

__all__ = ["ServingInfo", "ServingServicer"]

log = logging.getLogger(__name__)

FINISH_REASONS = {
    STOP: serving_pb2.FINISH_REASON_STOP,
    LENGTH: serving_pb2.FINISH_REASON_LENGTH,
    CANCELLED: serving_pb2.FINISH_REASON_CANCELLED,
    ERROR: serving_pb2.FINISH_REASON_ERROR,
}


class ServingServicer(serving_pb2_grpc.ServingServicer):
    def __init__(
        self,
        submitter: Submitter,
        *,
        poll_s: float = 0.25,
        cancel_grace_s: float = 10.0,
        media_fetcher: MediaFetcher | None = None,
    ):
        """media_fetcher: fetches the allowed hosts' media URLs (tpserve/server/media_fetch.py), the
        same one the HTTP API uses; None: every URL is refused by the media checks."""
        self._submitter = submitter
        self._media_fetcher = media_fetcher
        self._overflow_message = submitter.unread_overflow
        self._poll_s = poll_s  # how often a quiet stream looks at whether its client is still there
        self._cancel_grace_s = cancel_grace_s  # how long a cancelled stream waits for its Finished

    # --- Generate -------------------------------------------------------------------------------

    def Generate(self, request, context) -> Iterator[serving_pb2.GenerateResponse]:
        try:
            self._fetch_media(request)
            stream = self._submitter.submit(request)
        except RequestRefused as refusal:
            context.abort(refusal.code, refusal.message)
        # add_callback runs on cancellation, disconnection and deadline alike; False means the RPC
        # already ended before we got here.
        if not context.add_callback(stream.cancel):
            stream.cancel()
        stream.on_overflow(
            lambda: end_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED, self._overflow_message)
        )
        yield from self._relay(stream, context)

    def _relay(self, stream: Stream, context) -> Iterator[serving_pb2.GenerateResponse]:
        finished: Finished | None = None
        last_delta_at: float | None = None  # the first token's wait is time to first token, not this
        give_up_at: float | None = None
        try:
            while finished is None:
                events = merge_deltas(stream.next_events(timeout=self._poll_s))
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
                        last_delta_at = self._submitter.count_delta(event, last_delta_at)
                    elif isinstance(event, Finished):
                        finished = event
                        if stream.overflowed:  # end_call has ended the call already, or is about to
                            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._overflow_message)
                    yield response
        finally:
            if finished is None:
                # The client went away before the host's Finished reached it.
                stream.cancel()
                self._submitter.count_gone()

    def _response(self, event, context) -> serving_pb2.GenerateResponse:
        if isinstance(event, Prefilled):
            return serving_pb2.GenerateResponse(
                prefilled=True,
                cached_tokens=event.cached_tokens,
                prompt_logprobs=_as_protos(event.prompt_logprobs),
                prompt_token_ids=event.prompt_ids,
            )
        if isinstance(event, TokenDelta):
            return serving_pb2.GenerateResponse(
                token_ids=event.token_ids, text=event.text, logprobs=_as_protos(event.logprobs)
            )
        refusal = self._submitter.broke_mid_reply(event)
        if refusal is not None:
            context.abort(refusal.code, refusal.message)
        self._submitter.count_finished(event)
        return _final_response(event)

    # --- Tokenize and Info ----------------------------------------------------------------------

    def Tokenize(self, request, context) -> serving_pb2.TokenizeResponse:
        try:
            self._fetch_media(request)
            token_ids = self._submitter.tokenize(request)
        except RequestRefused as refusal:
            context.abort(refusal.code, refusal.message)
        return serving_pb2.TokenizeResponse(token_ids=token_ids, num_tokens=len(token_ids))

    def _fetch_media(self, request) -> None:
        """The request's media URLs replaced by their bytes, in place; a refused or failed fetch
        (a timeout too) raises RequestRefused INVALID_ARGUMENT, worded as over HTTP."""
        if self._media_fetcher is not None:
            self._media_fetcher.fill_blocking([request])

    def Info(self, request, context) -> serving_pb2.InfoResponse:
        info = self._submitter.info
        return serving_pb2.InfoResponse(
            model_name=info.model_name,
            tp_size=info.tp_size,
            num_lanes=info.num_lanes,
            context_size=info.context_size,
            room=info.room,
            version=VERSION,
            vocab_size=self._submitter.tokenizer.vocab_size,
            vision=info.vision,
            default_max_tokens=info.default_max_tokens or 0,
        )


def _as_protos(logprobs) -> list[serving_pb2.TokenLogprob]:
    return [
        serving_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[serving_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


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

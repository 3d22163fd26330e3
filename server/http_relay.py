"""How a request's streams become its OpenAI answer: read on worker threads, then sent whole or as
server-sent events (server/http_api.py takes the request and submits its choices).

The lane host's streams are read on worker threads (a Stream's wait blocks), one per live reply at
a time, under the API's limiter. A client that goes away cancels every stream not yet finished.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tpserve.server.chat_reply import ChatReply
from tpserve.server.http_errors import error_json, refusal_response, status_of
from tpserve.server.lane_stream import Stream, merge_deltas
from tpserve.server.openai_choices import total_usage
from tpserve.server.openai_reply import FINISH_REASONS, TOOL_CALLS, ReplyShape
from tpserve.server.requests import ERROR, STOP, Event, Finished, Prefilled, TokenDelta, Usage
from tpserve.server.submitter import Submitter
from tpserve.server.validation import RequestRefused

MULTI_STREAM_WAIT_S = 0.02  # n > 1 or a prompt list: how long one choice's stream is waited on in turn


class Relay:
    def __init__(self, submitter: Submitter, poll_s: float, limiter: anyio.CapacityLimiter):
        self._submitter = submitter
        self._poll_s = poll_s  # how long a reader thread waits for an event before looking again
        self._limiter = limiter

    async def whole(
        self,
        request: Request,
        streams: list[Stream],
        shape: ReplyShape,
        echoes: list[str],
        n: int,
        replies: list[ChatReply | None],
    ) -> Response:
        texts = [[echo] for echo in echoes]
        token_ids: list[list[int]] = [[] for _ in streams]
        logprobs: list[list] = [[] for _ in streams]
        ended: dict[int, Finished] = {}
        prefilled: dict[int, Prefilled] = {}
        async for index, event in self.events(streams, request):
            if isinstance(event, Prefilled):
                prefilled[index] = event
            elif isinstance(event, TokenDelta):
                texts[index].append(event.text)
                token_ids[index] += event.token_ids
                logprobs[index] += event.logprobs
            elif isinstance(event, Finished):
                refusal = self.failure(event)
                if refusal is not None:
                    return refusal_response(refusal)  # leaving _events cancels the other choices
                ended[index] = event
        if len(ended) < len(streams):
            return Response(status_code=499)  # the client went away; its streams are cancelled
        choices = []
        for i, reply in enumerate(replies):
            text = "".join(texts[i])
            choice = shape.with_prompt(
                shape.choice(i, text, token_ids[i], ended[i].reason, logprobs[i]), prefilled.get(i)
            )
            if reply is not None:
                choice["message"], called = reply.whole(text)
                if called and ended[i].reason == STOP:
                    choice["finish_reason"] = FINISH_REASONS[TOOL_CALLS]
            choices.append(choice)
        return JSONResponse(
            shape.whole_of(choices, total_usage([ended[i].usage for i in range(len(streams))], n))
        )

    async def server_sent_events(
        self,
        streams: list[Stream],
        shape: ReplyShape,
        include_usage: bool,
        echoes: list[str],
        n: int,
        replies: list[ChatReply | None],
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; _events then cancels the
        # streams, so their lanes are freed at the host's next boundary.
        for index, echo in enumerate(echoes):
            if shape.chat:
                yield _sse(shape.first_chunk(index))
            elif echo and not shape.wants_prompt:
                yield _sse(shape.chunk(echo, index=index))
        usages: dict[int, Usage] = {}
        async for index, event in self.events(streams, None):
            reply = replies[index]
            if isinstance(event, Prefilled) and shape.wants_prompt:  # the echo waits for its logprobs
                chunk = shape.chunk(echoes[index], index=index)
                chunk["choices"][0] = shape.with_prompt(chunk["choices"][0], event)
                yield _sse(chunk)
            elif isinstance(event, TokenDelta) and reply is not None:
                for delta in reply.push(event.text):
                    yield _sse(shape.delta_chunk(delta, index=index))
            elif isinstance(event, TokenDelta):
                if event.text or event.logprobs or shape.return_token_ids:
                    yield _sse(shape.chunk(event.text, event.token_ids, logprobs=event.logprobs, index=index))
            elif isinstance(event, Finished):
                refusal = self.failure(event)
                if refusal is not None:
                    yield _sse(error_json(status_of(refusal.code), refusal.message))
                    break
                reason = event.reason
                if reply is not None:
                    deltas, called = reply.finish()
                    for delta in deltas:
                        yield _sse(shape.delta_chunk(delta, index=index))
                    reason = TOOL_CALLS if called and reason == STOP else reason
                yield _sse(shape.chunk("", reason=reason, index=index))
                usages[index] = event.usage
        else:
            if include_usage:
                yield _sse(shape.usage_chunk(total_usage([usages[i] for i in sorted(usages)], n)))
        yield "data: [DONE]\n\n"

    async def events(
        self, streams: list[Stream], request: Request | None
    ) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) of every stream up to its Finished, read on a worker thread; a
        client that goes away (seen through `request`, or by this generator being cancelled)
        cancels every stream not yet finished."""
        finished = [False] * len(streams)
        last_delta_at: list[float | None] = [None] * len(streams)
        # One stream waits the whole poll; several share it, each waited on briefly in turn.
        wait_s = self._poll_s if len(streams) == 1 else min(self._poll_s, MULTI_STREAM_WAIT_S)
        try:
            while not all(finished):
                index = finished.index(False)
                events = await anyio.to_thread.run_sync(
                    streams[index].next_events, wait_s, limiter=self._limiter
                )
                for event in merge_deltas(events):
                    finished[index] = finished[index] or isinstance(event, Finished)
                    if isinstance(event, TokenDelta):
                        last_delta_at[index] = self._submitter.count_delta(event, last_delta_at[index])
                    yield index, event
                for other in range(index + 1, len(streams)):  # the others' events so far, no wait
                    if finished[other]:
                        continue
                    for event in merge_deltas(streams[other].next_events(0)):
                        finished[other] = finished[other] or isinstance(event, Finished)
                        if isinstance(event, TokenDelta):
                            last_delta_at[other] = self._submitter.count_delta(event, last_delta_at[other])
                        yield other, event
                if request is not None and not all(finished) and await request.is_disconnected():
                    return
        finally:
            for stream, done in zip(streams, finished):
                if not done:
                    stream.cancel()
                    self._submitter.count_gone()

    def failure(self, event: Finished) -> RequestRefused | None:
        """How a reply that ended in an error answers (counting every ending in the metrics): a
        broken engine as UNAVAILABLE (503), this stream's own failure as INTERNAL (500); None for
        replies that ended well. OpenAI's finish reasons have no word for an error."""
        refusal = self._submitter.broke_mid_reply(event)
        if refusal is not None:
            return refusal
        self._submitter.count_finished(event)
        if event.reason == ERROR:
            return RequestRefused(grpc.StatusCode.INTERNAL, event.error or "the reply failed")
        return None


def _sse(value: dict) -> str:
    return f"data: {json.dumps(value, ensure_ascii=False, separators=(',', ':'))}\n\n"

"""How a request's streams become its OpenAI answer: read on worker threads, then sent whole or as
server-sent events (tpserve/server/http_api.py takes the request and submits its choices).

The lane host's streams are read on the event loop itself: each stream's listener (called on the
thread that puts its events) marks its request's reader as having news, and one call into the loop
wakes every reader marked since the last (Wakeups), so a step's tokens cost the putting thread about
one wake-up, not one per stream, and no worker thread or thread hop; no number of live replies waits
for a thread. A client that goes away cancels every stream not yet finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tpserve.server.chat_parsing import ReplyReader
from tpserve.server.http_errors import error_json, refusal_response, status_of
from tpserve.server.lane_stream import Stream, merge_deltas
from tpserve.server.openai_choices import total_usage
from tpserve.server.openai_reply import FINISH_REASONS, TOOL_CALLS, ReplyShape, openai_message
from tpserve.server.openai_stream_choice import ChoiceChunks
from tpserve.server.requests import ERROR, STOP, Event, Finished, Prefilled, TokenDelta, Usage
from tpserve.server.submitter import Submitted, Submitter
from tpserve.server.validation import RequestRefused


@dataclass(frozen=True)
class StreamUsage:
    """stream_options: a last chunk with the request's usage, and (vLLM's continuous_usage_stats)
    every chunk with its choice's usage so far."""

    include: bool = False
    continuous: bool = False


class Wakeups:
    """Readers' asyncio events set from other threads, batched: the first mark after a drain
    schedules one drain on the loop, later marks before it only join the set."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._marked: set[asyncio.Event] = set()

    def mark(self, news: asyncio.Event) -> None:
        """Any thread: `news` is set on the loop soon."""
        with self._lock:
            first = not self._marked
            self._marked.add(news)
        if first:
            with contextlib.suppress(RuntimeError):  # the loop closed (the server stopped): no reader
                self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            marked, self._marked = self._marked, set()
        for news in marked:
            news.set()


class Relay:
    def __init__(self, submitter: Submitter, poll_s: float):
        self._submitter = submitter
        self._poll_s = poll_s  # how long a quiet reply waits before it looks at its client again
        self._wakeups = Wakeups(asyncio.get_running_loop())  # made on the server's loop

    async def whole(
        self,
        request: Request,
        submitted: list[Submitted],
        shape: ReplyShape,
        echoes: list[str],
        n: int,
        replies: list[ReplyReader | None],
    ) -> Response:
        texts = [[echo] for echo in echoes]
        token_ids: list[list[int]] = [[] for _ in submitted]
        logprobs: list[list] = [[] for _ in submitted]
        ended: dict[int, Finished] = {}
        prefilled: dict[int, Prefilled] = {}
        async for index, events in self.events([s.stream for s in submitted], request):
            for event in events:
                if isinstance(event, Prefilled):
                    prefilled[index] = event
                elif isinstance(event, TokenDelta):
                    texts[index].append(event.text)
                    token_ids[index] += event.token_ids
                    logprobs[index] += event.logprobs
                elif isinstance(event, Finished):
                    refusal = self.failure(event)
                    if refusal is not None:
                        return refusal_response(refusal)  # leaving events cancels the other choices
                    ended[index] = event
        if len(ended) < len(submitted):
            return Response(status_code=499)  # the client went away; its streams are cancelled
        choices = []
        for i, reply in enumerate(replies):
            text = "".join(texts[i])
            choice = shape.choice(i, text, token_ids[i], ended[i].reason, logprobs[i])
            if shape.return_token_ids and not shape.chat:
                choice["prompt_token_ids"] = list(submitted[i].prompt_ids)
            choice = shape.with_prompt(choice, prefilled.get(i))
            if reply is not None:
                message, called = reply.whole(text)
                choice["message"] = openai_message(message)
                if called and ended[i].reason == STOP:
                    choice["finish_reason"] = FINISH_REASONS[TOOL_CALLS]
            choices.append(choice)
        whole = shape.whole_of(choices, total_usage([ended[i].usage for i in range(len(submitted))], n))
        if shape.return_token_ids and shape.chat:  # one prompt for every choice of a chat
            whole["prompt_token_ids"] = list(submitted[0].prompt_ids)
        return JSONResponse(whole)

    async def server_sent_events(
        self,
        submitted: list[Submitted],
        shape: ReplyShape,
        usage: StreamUsage,
        echoes: list[str],
        n: int,
        replies: list[ReplyReader | None],
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; events then cancels the
        # streams, so their lanes are freed at the host's next boundary.
        outs = [
            ChoiceChunks(
                s.prompt_ids,
                s.max_tokens,
                continuous_usage=usage.continuous,
                return_token_ids=shape.return_token_ids,
                chat=shape.chat,
            )
            for s in submitted
        ]
        for index, echo in enumerate(echoes):
            if shape.chat:
                yield _sse(outs[index].now(shape.first_chunk(index)))
                if echo:
                    yield _sse(outs[index].now(shape.delta_chunk({"content": echo}, index=index)))
            elif echo and not shape.wants_prompt:
                yield _sse(outs[index].now(shape.chunk(echo, index=index)))
        usages: dict[int, Usage] = {}
        async for index, events in self.events([s.stream for s in submitted], None):
            sending, refusal = self._chunks(index, events, shape, outs[index], replies[index], echoes, usages)
            for chunk in sending:
                yield _sse(chunk)
            if refusal is not None:
                yield _sse(error_json(status_of(refusal.code), refusal.message))
                break
        else:
            if usage.include:
                yield _sse(shape.usage_chunk(total_usage([usages[i] for i in sorted(usages)], n)))
        yield "data: [DONE]\n\n"

    def _chunks(
        self,
        index: int,
        events: list[Event],
        shape: ReplyShape,
        out: ChoiceChunks,
        reply: ReplyReader | None,
        echoes: list[str],
        usages: dict[int, Usage],
    ) -> tuple[list[dict], RequestRefused | None]:
        """One read of choice `index`'s stream as the chunks to send now, and the refusal it ended in."""
        sending: list[dict] = []
        for event in events:
            if isinstance(event, Prefilled) and shape.wants_prompt:  # the echo waits for its logprobs
                chunk = shape.chunk(echoes[index], index=index)
                chunk["choices"][0] = shape.with_prompt(chunk["choices"][0], event)
                sending += out.add(chunk)
            elif isinstance(event, TokenDelta):
                out.count(len(event.token_ids))
                if reply is not None:
                    for delta in reply.push(event.text):
                        sending += out.add(shape.delta_chunk(delta, index=index))
                elif event.text or event.logprobs or shape.return_token_ids:
                    sending += out.add(
                        shape.chunk(event.text, event.token_ids, logprobs=event.logprobs, index=index)
                    )
            elif isinstance(event, Finished):
                refusal = self.failure(event)
                if refusal is not None:
                    return sending, refusal
                reason = event.reason
                if reply is not None:
                    deltas, called = reply.finish()
                    for delta in deltas:
                        sending += out.add(shape.delta_chunk(delta, index=index))
                    reason = TOOL_CALLS if called and reason == STOP else reason
                sending += out.finish(shape.chunk("", reason=reason, index=index), event.usage)
                usages[index] = event.usage
                return sending, None
        return sending + out.end_read(), None

    async def events(
        self, streams: list[Stream], request: Request | None
    ) -> AsyncIterator[tuple[int, list[Event]]]:
        """(choice index, the events of one read) of every stream up to its Finished, read when a
        stream's listener wakes this reader; a client that goes away (seen through `request`, or by
        this generator being cancelled) cancels every stream not yet finished."""
        finished = [False] * len(streams)
        last_delta_at: list[float | None] = [None] * len(streams)
        news = asyncio.Event()
        try:
            for stream in streams:
                # on the putting thread, after every event (and once now if events wait already)
                stream.listen(functools.partial(self._wakeups.mark, news))
            while not all(finished):
                with anyio.move_on_after(self._poll_s):
                    await news.wait()
                news.clear()  # before reading: an event put after the reads wakes the next wait
                for at, stream in enumerate(streams):
                    if finished[at]:
                        continue
                    events = merge_deltas(stream.next_events(0))
                    for event in events:
                        finished[at] = finished[at] or isinstance(event, Finished)
                        if isinstance(event, TokenDelta):
                            last_delta_at[at] = self._submitter.count_delta(event, last_delta_at[at])
                    if events:
                        yield at, events
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

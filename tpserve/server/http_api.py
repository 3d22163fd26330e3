"""Rank 0's OpenAI-compatible HTTP API: a Starlette app over the same Submitter as gRPC.

Routes: POST /v1/chat/completions and /v1/completions (whole, or server-sent events with
`stream: true`), GET /v1/models, GET /v1/models/{id}, vLLM's POST /tokenize and /detokenize and
GET /tokenizer_info and /version (tpserve/server/http_tokenize.py), SageMaker's POST /invocations, GET
/metrics (Prometheus, tpserve's series and vLLM's names, behind the API key like the rest) and GET /health
(open without the API key). Starlette because it is the small ASGI core FastAPI itself is built on: requests
are checked by hand against the gRPC wording (tpserve/server/openai_request.py), so FastAPI's pydantic layer
would only add a second, differently worded set of refusals. A client that disconnects cancels its stream.

Each choice's stream is read and answered by tpserve/server/http_relay.py, on the event loop; submits
and tokenizing run on worker threads from one pool sized like the gRPC server's, so a queued request
is never stuck behind them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cache, partial

import anyio
import anyio.from_thread
import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tpserve.server.api_key import key_matches
from tpserve.server.beam_steps import run_beam_search
from tpserve.server.chat_parsing import ChatParsing
from tpserve.server.heap import LARGE_REQUEST_BYTES, give_back_free_memory
from tpserve.server.http_body import BodyRefused, read_json_object
from tpserve.server.http_errors import (
    HttpRefusal,
    http_exception,
    refusal_response,
    unauthorized_response,
)
from tpserve.server.http_relay import Relay, StreamUsage
from tpserve.server.http_tokenize import (
    detokenize_reply,
    tokenize_reply,
    tokenizer_info_reply,
    version_reply,
)
from tpserve.server.media_fetch import MediaFetcher
from tpserve.server.openai_beam import beam_reply
from tpserve.server.openai_choices import cancel_all
from tpserve.server.openai_reply import ReplyShape
from tpserve.server.openai_request import OpenAIRequest, parse_completion
from tpserve.server.request_size import TEXT_BYTES
from tpserve.server.submitter import Submitted, Submitter
from tpserve.server.validation import RequestRefused

EXTRA_THREADS = 16  # beyond one per lane and queue place: submits, tokenizing


class OpenAIApi:
    def __init__(
        self,
        submitter: Submitter,
        *,
        api_key: str = "",
        poll_s: float = 0.25,
        queue_size: int = 64,
        tool_call_parser: str = "",
        reasoning_parser: str = "",
        body_timeout_s: float = 30.0,
        max_body_bytes: int = TEXT_BYTES,
        cors_origins: tuple[str, ...] = (),
        media_fetcher: MediaFetcher | None = None,
    ):
        """The parsers: "" reads the family from the chat template, "none" turns it off.
        cors_origins: the origins browsers may call from ("*": any), answered by Starlette's CORS.
        media_fetcher: fetches the allowed hosts' image and video URLs before a request is queued
        (tpserve/server/media_fetch.py); None: every URL is refused by the media checks."""
        self._media_fetcher = media_fetcher
        self._cors_origins = cors_origins
        self._submitter = submitter
        self._body_timeout_s = body_timeout_s
        self._max_body_bytes = max_body_bytes  # 413 past it (tpserve/server/request_size.py)
        self._api_key = api_key
        self._model = submitter.info.model_name  # what replies name; requests may name any alias
        self._model_names = submitter.info.model_names
        self._temperature = submitter.info.openai_temperature  # an unset temperature's, as vLLM's
        # How chat replies are read: the tool-call family, <think> reasoning or harmony channels.
        self._parsing = ChatParsing(submitter.tokenizer, tool_call_parser, reasoning_parser)
        # Each token's text decoded once: a whole-vocabulary reply (logprobs -1) names every token
        # at every position. At most the vocabulary's size of short strings.
        self._token_text = cache(self._decode_token)
        self._poll_s = poll_s  # how long a quiet reply waits before it looks at its client again
        self._num_threads = submitter.info.num_lanes + queue_size + EXTRA_THREADS
        self._limiter: anyio.CapacityLimiter | None = None
        self._relay: Relay | None = None

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            Route("/invocations", self.invocations, methods=["POST"]),
        ]
        handlers = {HTTPException: http_exception}
        middleware = []
        if self._cors_origins:
            cors = {"allow_origins": list(self._cors_origins), "allow_methods": ["*"], "allow_headers": ["*"]}
            middleware.append(Middleware(CORSMiddleware, **cors))
        return Starlette(
            routes=routes, exception_handlers=handlers, lifespan=self._lifespan, middleware=middleware
        )

    @asynccontextmanager
    async def _lifespan(self, app) -> AsyncIterator[None]:
        # Created on the server's event loop, where anyio can tell which loop it is.
        self._limiter = anyio.CapacityLimiter(self._num_threads)
        self._relay = Relay(self._submitter, self._poll_s)
        yield

    # --- routes ---------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self._submitter.serving:
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not serving"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        """The Prometheus page, behind the key when one is set (the metrics port has no key check)."""
        if not self._authorized(request):
            return unauthorized_response()
        return Response(self._submitter.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return unauthorized_response()
        return JSONResponse(
            {"object": "list", "data": [self._model_card(name) for name in self._model_names]}
        )

    async def model(self, request: Request) -> Response:
        if not self._authorized(request):
            return unauthorized_response()
        if request.path_params["model_id"] not in self._model_names:
            return refusal_response(self._unknown_model(request.path_params["model_id"]))
        return JSONResponse(self._model_card(request.path_params["model_id"]))

    async def tokenize(self, request: Request) -> Response:
        fill_media = self._fill_media_from_worker if self._media_fetcher is not None else None
        return await self._answer(request, partial(tokenize_reply, fill_media=fill_media))

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, detokenize_reply)

    async def version(self, request: Request) -> Response:
        return JSONResponse(version_reply())

    async def tokenizer_info(self, request: Request) -> Response:
        if not self._authorized(request):
            return unauthorized_response()
        return JSONResponse(tokenizer_info_reply(self._submitter))

    async def _answer(self, request: Request, reply: Callable[[Submitter, dict], dict]) -> Response:
        """A route answered at once from the body (tokenizing runs on a worker thread)."""
        if not self._authorized(request):
            return unauthorized_response()
        try:
            body = await read_json_object(request, self._body_timeout_s, self._max_body_bytes)
            return JSONResponse(await self._on_worker(reply, self._submitter, body))
        except (HttpRefusal, RequestRefused) as refusal:
            return refusal_response(refusal)
        except BodyRefused as refusal:
            return refusal_response(HttpRefusal(refusal.status, refusal.message))
        except ClientDisconnect:
            return Response(status_code=499)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, self._parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, self._parse_completion)

    async def invocations(self, request: Request) -> Response:
        """SageMaker's route (vLLM serves it too): a body with messages is a chat, any other a completion."""

        def parse(body: dict) -> OpenAIRequest:
            return self._parse_chat(body) if "messages" in body else self._parse_completion(body)

        return await self._generate(request, parse)

    # --- generating -----------------------------------------------------------------------------

    def _parse_chat(self, body: dict) -> OpenAIRequest:
        return self._parsing.parse_chat(body, self._temperature)

    def _parse_completion(self, body: dict) -> OpenAIRequest:
        return parse_completion(body, self._temperature)

    async def _generate(self, request: Request, parse: Callable[[dict], OpenAIRequest]) -> Response:
        if not self._authorized(request):
            return unauthorized_response()
        submitted: list[Submitted] = []
        refused: Response | None = None
        try:
            parsed = parse(await read_json_object(request, self._body_timeout_s, self._max_body_bytes))
            if parsed.model is not None and parsed.model not in self._model_names:
                raise self._unknown_model(parsed.model)
            if self._media_fetcher is not None:  # here, on the event loop: the engine's thread never waits
                await self._media_fetcher.fill(parsed.choices)
            if parsed.beam is not None:
                return await self._beam_search(parsed)
            for choice in parsed.choices:  # one stream per choice, in choice order
                submitted.append(await self._on_worker(self._submitter.submit_sized, choice))
        except (HttpRefusal, RequestRefused) as refusal:
            cancel_all([s.stream for s in submitted])
            refused = refusal_response(refusal)
        except BodyRefused as refusal:
            refused = refusal_response(HttpRefusal(refusal.status, refusal.message))
        except ClientDisconnect:
            cancel_all([s.stream for s in submitted])
            refused = Response(status_code=499)
        if refused is not None:
            # Past the refusal's traceback and the parsed body, a big prompt's copies are gone: the
            # heap's free memory goes back now (tpserve/server/heap.py), not at some later request.
            parsed = None
            if int(request.headers.get("content-length") or 0) >= LARGE_REQUEST_BYTES:
                give_back_free_memory()
            return refused
        shape = ReplyShape(
            chat=parsed.chat,
            model=self._model,
            return_token_ids=parsed.return_token_ids,
            logprobs=parsed.generate.HasField("logprobs"),
            token_text=self._token_text,
            echo_logprobs=parsed.echo_logprobs,
            prompt_logprobs=parsed.prompt_logprobs,
        )
        replies = self._parsing.replies(parsed, len(submitted))
        echo = _echoed_message if parsed.chat else self._prompt_text
        echoes = [echo(choice) if parsed.echo else "" for choice in parsed.choices]
        if parsed.stream:
            events = self._relay.server_sent_events(
                submitted,
                shape,
                StreamUsage(parsed.include_usage, parsed.continuous_usage),
                echoes,
                parsed.num_per_prompt,
                replies,
            )
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return await self._relay.whole(request, submitted, shape, echoes, parsed.num_per_prompt, replies)

    async def _beam_search(self, parsed: OpenAIRequest) -> Response:
        """Each prompt's search in turn, on a worker thread (tpserve/server/beam_steps.py); one whole
        reply."""
        results = []
        for prompt in parsed.choices[:: parsed.num_per_prompt]:
            beam = parsed.beam
            results.append(
                await self._on_worker(
                    run_beam_search, self._submitter, prompt, beam.width, beam.length_penalty
                )
            )
        shape = ReplyShape(chat=parsed.chat, model=self._model, return_token_ids=parsed.return_token_ids)
        skip = not parsed.generate.keep_special_tokens
        decode = partial(self._submitter.tokenizer.decode, skip_special_tokens=skip)
        return JSONResponse(beam_reply(shape, results, decode))

    async def _on_worker(self, function: Callable, *args):
        """function(*args) on a worker thread, its refusal raised here. The refusal crosses the thread
        as a value, without a traceback: raised out of anyio's await, it would sit in a cycle with
        that frame (future -> exception -> traceback -> frame -> future) whose locals hold `args`
        (a big prompt, megabytes), kept until the garbage collector next ran a full pass."""
        outcome = await anyio.to_thread.run_sync(_refusal_as_value, function, *args, limiter=self._limiter)
        if not isinstance(outcome, _Refusal):
            return outcome
        refusal = outcome.refusal
        try:
            raise refusal
        finally:  # nor a cycle with this frame: it holds the refusal, whose traceback holds the frame
            del outcome, refusal

    # --- helpers --------------------------------------------------------------------------------

    def _fill_media_from_worker(self, requests) -> None:
        """The fetcher, awaited on the event loop from a worker thread (tokenizing runs on one)."""
        anyio.from_thread.run(self._media_fetcher.fill, requests)

    def _authorized(self, request: Request) -> bool:
        return key_matches(request.headers.getlist("authorization"), self._api_key)

    def _prompt_text(self, choice) -> str:
        """A choice's prompt as text, for echo (token-id prompts decoded, special tokens kept: the
        echo shows the prompt that ran, as vLLM's does)."""
        if choice.HasField("prompt"):
            return choice.prompt
        return self._submitter.tokenizer.decode(list(choice.prompt_token_ids), skip_special_tokens=False)

    def _decode_token(self, token_id: int) -> str:
        """One token's text in log probabilities: a special token by its name (as OpenAI's show)."""
        return self._submitter.tokenizer.decode([token_id], skip_special_tokens=False)

    def _model_card(self, name: str) -> dict:
        info = self._submitter.info
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "tpserve",
            "max_model_len": info.context_size,
            "vocab_size": self._submitter.tokenizer.vocab_size,  # for clients that send token ids
        }

    def _unknown_model(self, name: str) -> HttpRefusal:
        message = f"the model {name!r} does not exist; this server serves {self._model!r}"
        return HttpRefusal(404, message, param="model", code="model_not_found")


def _echoed_message(choice) -> str:
    """vLLM's chat echo: the last message's text, where the reply continues in that message's role
    (an assistant's, or any with add_generation_prompt false); else nothing."""
    last = choice.messages[-1]
    generation_prompt = not choice.HasField("add_generation_prompt") or choice.add_generation_prompt
    if generation_prompt and last.role != "assistant":
        return ""
    return last.content or "".join(part.text for part in last.parts)


@dataclass(frozen=True)
class _Refusal:
    refusal: HttpRefusal | RequestRefused


def _refusal_as_value(function: Callable, *args):
    try:
        return function(*args)
    except (HttpRefusal, RequestRefused) as refusal:
        return _Refusal(refusal.with_traceback(None))

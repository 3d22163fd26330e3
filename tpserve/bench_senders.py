"""How `tpserve bench` sends one request and times it: over tpserve's gRPC API, or over the OpenAI HTTP
API of any server (tpserve's own, llama.cpp's server, vLLM), streamed as server-sent events.

Both report the same RequestResult, so one load can be timed on several servers: time to first
token, each later arrival's gap (inter-token latency, ITL: one sample per message or event that
carries new tokens, as vLLM's benchmark counts them) and the number of output tokens (the server's
usage where it reports one, else the events that carried text).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import grpc
import httpx

from tpserve.openai_body import openai_body
from tpserve.ranks.errors import UserError
from tpserve.v1 import serving_pb2, serving_pb2_grpc

FAILED_REASONS = (serving_pb2.FINISH_REASON_CANCELLED, serving_pb2.FINISH_REASON_ERROR)
CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RequestResult:
    sent_s: float  # since the run began
    ttft_s: float | None  # None when no token came
    total_s: float
    num_output_tokens: int
    error: str | None  # a gRPC status code's or HTTP status's name, or an unexpected finish reason
    itl_s: tuple[float, ...] = ()  # gaps between arrivals that carried tokens, after the first

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.num_output_tokens - 1)


def _result(sent: float, arrivals: list[float], num_tokens: int, error: str | None, run_start: float):
    end = time.monotonic()
    return RequestResult(
        sent_s=sent - run_start,
        ttft_s=arrivals[0] - sent if arrivals else None,
        total_s=end - sent,
        num_output_tokens=num_tokens,
        error=error,
        itl_s=tuple(later - earlier for earlier, later in zip(arrivals, arrivals[1:])),
    )


class GrpcSender:
    """tpserve's Generate over gRPC (the API key, if any, as `authorization` metadata)."""

    def __init__(self, target: str, *, api_key: str = "", timeout_s: float = 600.0):
        self.target = target
        self._channel = grpc.insecure_channel(target)
        self._stub = serving_pb2_grpc.ServingStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s

    def describe(self) -> tuple[str, int | None]:
        """The served model's name and vocabulary size."""
        try:
            info = self._stub.Info(
                serving_pb2.InfoRequest(), timeout=CONNECT_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise UserError(f"cannot reach {self.target}: {error.code().name}: {error.details()}") from error
        return info.model_name, info.vocab_size

    def send(self, request: serving_pb2.GenerateRequest, run_start: float) -> RequestResult:
        sent = time.monotonic()
        arrivals: list[float] = []
        num_tokens, error = 0, None
        try:
            for response in self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata):
                if response.token_ids:
                    arrivals.append(time.monotonic())
                num_tokens += len(response.token_ids)
                if response.finish_reason in FAILED_REASONS:
                    error = serving_pb2.FinishReason.Name(response.finish_reason)
        except grpc.RpcError as rpc_error:
            error = rpc_error.code().name
        return _result(sent, arrivals, num_tokens, error, run_start)

    def close(self) -> None:
        self._channel.close()


class OpenAISender:
    """POST /v1/completions or /v1/chat/completions with `stream: true` on any OpenAI-compatible server."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str = "",
        model: str | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 64,
    ):
        self.target = base_url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.target,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._model = model

    def describe(self) -> tuple[str, int | None]:
        """The model to ask for (--model, else the first the server lists) and its vocabulary size
        where the server says (tpserve does; most servers do not)."""
        try:
            response = self._client.get("/models", timeout=CONNECT_TIMEOUT_S)
            response.raise_for_status()
            cards = response.json().get("data") or []
        except (httpx.HTTPError, json.JSONDecodeError, AttributeError) as error:
            raise UserError(f"cannot list the models of {self.target}: {error}") from error
        card = next((c for c in cards if self._model in (None, c.get("id"))), None)
        if card is None:
            raise UserError(
                f"{self.target} serves no model {self._model!r}"
                if self._model
                else f"{self.target} lists no model"
            )
        self._model = card["id"]
        return card["id"], card.get("vocab_size")

    def send(self, request: serving_pb2.GenerateRequest, run_start: float) -> RequestResult:
        translated = openai_body(request, self._model)
        if translated is None:
            raise UserError("a prompt the OpenAI API cannot carry (several inputs at once)")
        path, body = translated
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        sent = time.monotonic()
        arrivals: list[float] = []
        num_events, usage_tokens, error = 0, None, None
        try:
            with self._client.stream("POST", f"/{path}", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    error = f"HTTP {response.status_code}"
                for line in response.iter_lines() if error is None else ():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        error = "stream error"
                        break
                    for choice in event.get("choices") or []:
                        if choice.get("text") or (choice.get("delta") or {}).get("content"):
                            arrivals.append(time.monotonic())
                            num_events += 1
                        if choice.get("finish_reason") not in (None, "stop", "length"):
                            error = str(choice["finish_reason"])
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
        except (httpx.HTTPError, json.JSONDecodeError) as http_error:
            error = type(http_error).__name__
        num_tokens = usage_tokens if usage_tokens is not None else num_events
        return _result(sent, arrivals, num_tokens, error, run_start)

    def close(self) -> None:
        self._client.close()

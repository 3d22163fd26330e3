"""A refusal raised on the HTTP API's worker thread lets go of the request at once: the prompt it was
called with is freed without waiting for the garbage collector (a 4 MiB prompt per refused request
kept rank 0 some 15% above its baseline until the next full collection, issue 25)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import anyio
import grpc
import pytest
from daemon import wait_until

from tpserve.server.http_api import OpenAIApi
from tpserve.server.validation import RequestRefused


class Prompt:
    """Stands for a request's big prompt: an object a weak reference can watch."""


def refuse(prompt: Prompt) -> None:
    raise RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, "prompt is too long")


def test_a_refused_request_is_freed_without_the_garbage_collector():
    api = SimpleNamespace(_limiter=None)  # _on_worker reads only the thread limiter
    prompt = Prompt()
    watched = weakref.ref(prompt)

    async def call(prompt: Prompt) -> str:
        try:
            await OpenAIApi._on_worker(api, refuse, prompt)
        except RequestRefused as refusal:
            return refusal.message
        return "not refused"

    gc.collect()
    gc.disable()
    try:
        assert anyio.run(call, prompt) == "prompt is too long"
        del prompt
        # The worker thread drops its own reference just after handing the outcome back.
        wait_until(lambda: watched() is None, "the refused prompt to be freed", 10)
    finally:
        gc.enable()


def test_what_the_worker_returns_comes_back_as_is():
    api = SimpleNamespace(_limiter=None)
    assert anyio.run(OpenAIApi._on_worker, api, lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):  # anything but a refusal is raised as it was
        anyio.run(OpenAIApi._on_worker, api, lambda: 1 / 0)

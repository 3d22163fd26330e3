"""An HTTP request's body read as one JSON object, every way it can be malformed refused as a 400
whose message says which (tests/golden/errors/http/), before anything else reads it.

Python's own reader lets through what the rest of the server cannot take: bytes that are not
UTF-8 (it decodes with surrogatepass, so ED A0 80 reads as a lone surrogate), escaped lone
surrogates ("\\ud800", which no protobuf string or UTF-8 encoder accepts), nesting past the
interpreter's recursion limit (RecursionError) and integers past its digit limit (ValueError).
"""

from __future__ import annotations

import json
import re
import sys

import anyio
from starlette.requests import Request

from tpserve.server.request_size import TEXT_BYTES

# An escaped UTF-16 surrogate (paired or not): only a body holding one needs the slower check.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
NOT_UTF8 = "the request body is not valid UTF-8 (byte {byte:#04x} at offset {offset})"
NESTED_TOO_DEEPLY = "the request body is nested too deeply"
HUGE_INTEGER = "the request body holds an integer of more than {digits} digits"
LONE_SURROGATE = "the request body holds a lone UTF-16 surrogate (an escape such as \\ud800 with no pair)"


class BodyRefused(Exception):
    """A body that cannot be read: the HTTP status and the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def read_json_object(request: Request, timeout_s: float, max_bytes: int = TEXT_BYTES) -> dict:
    """The body as a JSON object; 408 when it has not all arrived within timeout_s (a client that
    declared more than it sends is otherwise held until it gives up), 413 past max_bytes. As vLLM,
    a body is read as JSON only when it says it is (a form body is never guessed at)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise BodyRefused(400, f"the request body must be application/json (got {media_type or 'no type'!r})")
    declared = request.headers.get("content-length")
    too_large = BodyRefused(413, f"the request body is larger than {max_bytes} bytes")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise too_large
    except TimeoutError:
        raise BodyRefused(408, f"the request body did not arrive within {timeout_s:g} s") from None
    return parse_json_object(bytes(body))


def parse_json_object(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")  # strict: no surrogates, no overlong forms
    except UnicodeDecodeError as error:
        raise BodyRefused(400, NOT_UTF8.format(byte=body[error.start], offset=error.start)) from None
    try:
        value = json.loads(text)
        if _SURROGATE_ESCAPE.search(text) is not None:
            json.dumps(value, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    except RecursionError:
        raise BodyRefused(400, NESTED_TOO_DEEPLY) from None
    except UnicodeEncodeError:
        raise BodyRefused(400, LONE_SURROGATE) from None
    except json.JSONDecodeError as error:
        raise BodyRefused(400, f"the request body is not valid JSON ({error})") from None
    except ValueError:  # the one other ValueError json raises: an integer past the digit limit
        raise BodyRefused(400, HUGE_INTEGER.format(digits=sys.get_int_max_str_digits())) from None
    if not isinstance(value, dict):
        raise BodyRefused(400, "the request body must be a JSON object")
    return value

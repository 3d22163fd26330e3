"""What the vision daemon tests share (tests/test_vision_daemon.py, tests/test_qwen_vl_daemon.py): the
flags that cut images into prompt passes and cache blocks of 16, one chat request with or without an
image, and corrupted copies of an image's bytes."""

from __future__ import annotations

import random
from collections.abc import Iterator

from daemon import Reply, read_reply

from tpserve.v1 import serving_pb2

MAX_TOKENS = 6
# Prompts go in passes of 16 tokens and the cache shares blocks of 16: both cut images.
VISION_ARGS = (
    "--vision",
    "--context",
    "256",
    "--lanes",
    "4",
    "--max-prefill-tokens",
    "16",
    "--kv-block-size",
    "16",
)


def ask(image: bytes | None, text: str = "what is in this picture", **fields) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    message = request.messages.add(role="user")
    if image is not None:
        message.parts.add(media=serving_pb2.Media(mime_type="image/png", data=image))
    message.parts.add(text=text)
    return request


def generate(daemon, request) -> Reply:
    return read_reply(daemon.stub.Generate(request, timeout=120))


def corrupted(good: bytes, count: int, seed: int = 5) -> Iterator[bytes]:
    """`count` copies of `good` with a few bytes overwritten, some also cut short."""
    rng = random.Random(seed)
    for _ in range(count):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(1, len(data))]
        yield bytes(data)

"""What the vision daemon tests share (tests/test_vision_daemon.py, tests/test_qwen_vl_daemon.py): the
flags that cut images into prompt passes and cache blocks of 16, one chat request with or without an
image, requests together against their solo runs, one question about the same image twice and then
another, and corrupted copies of an image's
bytes."""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
from daemon import Reply, read_reply
from grpc_health.v1 import health_pb2
from PIL import Image
from tiny_llava import block_image
from tiny_video import MIME_TYPES

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


def ask_video(
    video: bytes, text: str = "what is in this video", fmt: str = "mp4"
) -> serving_pb2.GenerateRequest:
    """ask's greedy chat with the video's bytes (`fmt`: mp4 or webm) before the text."""
    request = ask(None, text)
    media = serving_pb2.Media(mime_type=MIME_TYPES[fmt], data=video)
    request.messages[0].parts.insert(0, serving_pb2.ContentPart(media=media))
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


def same_then_other(daemon, size: tuple[int, int]) -> tuple[Reply, Reply]:
    """One question about an image, again about the same image, then about another: the second
    reply repeats the first and the third differs; the second and the third."""
    question = "what is in this picture, the quick brown fox or the lazy dog?"
    first, again, other = (generate(daemon, ask(block_image(seed, size), question)) for seed in (21, 21, 22))
    assert first.ok and again.ok and other.ok
    assert again.token_ids == first.token_ids
    assert other.token_ids != first.token_ids
    return again, other


def check_transformers_greedy(daemon, size: tuple[int, int], more_than: int, greedy) -> None:
    """A chat with one image of `size` (a prompt past more_than tokens: the image's, cut by passes of
    16) gives greedy(model_dir, image, text): transformers' own greedy reply to the same chat."""
    image, text = block_image(11, size), "what is in this picture"
    reply = generate(daemon, ask(image, text))
    assert reply.ok, reply.details
    assert reply.last.usage.prompt_tokens > more_than
    assert reply.token_ids == greedy(daemon.model_dir, image, text)


def check_cache_across_images(daemon, size: tuple[int, int], image_end: int) -> None:
    """same_then_other, where the repeat's cache hit covers the image (the prompt's first image_end
    tokens) and the other image's at most the block of 16 before it."""
    again, other = same_then_other(daemon, size)
    assert again.last.usage.cached_tokens >= image_end  # the hit covers the image's positions
    assert other.last.usage.cached_tokens < 16  # at most the block of text before it


def check_batched(daemon, requests: list[serving_pb2.GenerateRequest]) -> None:
    """A batch against solo runs: each request alone, then all at once; every reply whole and the
    same both ways."""
    solo = [generate(daemon, request) for request in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda request: generate(daemon, request), requests))
    assert all(reply.ok and len(reply.token_ids) == MAX_TOKENS for reply in solo + together)
    assert [reply.token_ids for reply in together] == [reply.token_ids for reply in solo]


def check_beside_images(daemon, size: tuple[int, int], other_size: tuple[int, int]) -> None:
    """check_batched on two questions about one image of `size`, one about another of other_size
    (sampled) and one with no image."""
    requests = [
        ask(block_image(31, size)),
        ask(None, "hello world"),
        ask(block_image(32, other_size), "the lazy dog", temperature=0.9, seed=7),
        ask(block_image(31, size), "the quick brown fox"),
    ]
    check_batched(daemon, requests)


def check_broken_and_sliver_images(daemon, good: bytes) -> None:
    """A 1x250 sliver is refused for its aspect; then check_broken on 20 copies of the image `good`."""
    sliver = io.BytesIO()
    Image.new("RGB", (1, 250)).save(sliver, format="PNG")
    refused = generate(daemon, ask(sliver.getvalue()))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 200 times as long as it is wide" in refused.details
    check_broken(daemon, good, ask, 20)


def http_chat(daemon, kind: str, mime_type: str, data: bytes, text: str = "what") -> httpx.Response:
    """One greedy chat over HTTP with a media part (kind "image" or "video") as a data: URL."""
    url = f"data:{mime_type};base64," + base64.b64encode(data).decode()
    content = [{"type": f"{kind}_url", f"{kind}_url": {"url": url}}, {"type": "text", "text": text}]
    body = {
        "model": daemon.model_name,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,  # gRPC's unset
        "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }
    return httpx.post(f"{daemon.http_url}/chat/completions", json=body, timeout=60)


def check_broken(daemon, good: bytes, asker, count: int) -> None:
    """`count` corrupted copies of the media `good` (each asked by asker(data)) each read or fail
    alone with INVALID_ARGUMENT, and the daemon serves on: healthy, and `good` still read."""
    for data in corrupted(good, count):
        reply = generate(daemon, asker(data))
        assert reply.ok or reply.code == grpc.StatusCode.INVALID_ARGUMENT, reply.details
    assert daemon.health() == health_pb2.HealthCheckResponse.SERVING
    assert generate(daemon, asker(good)).ok

"""--vision through the real two-rank daemon on a tiny LLaVA: image parts over gRPC and HTTP, every
image refusal word for word, fuzzed image bytes, the prompt cache across images, and replies that
equal their solo runs whether or not images sit beside them."""

from __future__ import annotations

import base64
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from daemon import read_reply, running_daemon
from google.protobuf import text_format
from grpc_health.v1 import health_pb2
from test_grpc_api import GOLDEN_DIR, LLAVA_LIMITS, read_golden
from tiny_llava import TOKENS_PER_IMAGE, block_image, write_tiny_llava

from tpserve.server.validation import VISION_NEEDED
from tpserve.v1 import serving_pb2

MAX_TOKENS = 6
LLAVA_GOLDEN = [
    path for path in sorted(GOLDEN_DIR.glob("*.txt")) if read_golden(path)[0].get("server") == "llava"
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Written once for the module: building and saving the random llava takes seconds."""
    return write_tiny_llava(tmp_path_factory.mktemp("llava-model"))


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    limits = [f"--{key.replace('_', '-')}={value}" for key, value in LLAVA_LIMITS.items()]
    # Prompts go in passes of 16 tokens and the cache shares blocks of 16: both cut images.
    args = (
        "--vision",
        "--context",
        "256",
        "--lanes",
        "4",
        "--max-prefill-tokens",
        "16",
        "--kv-block-size",
        "16",
        *limits,
    )
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("llava-logs"), *args) as daemon:
        daemon.model_name = Path(model_dir).name
        yield daemon


def ask(image: bytes | None, text: str = "what is in this picture", **fields) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
    message = request.messages.add(role="user")
    if image is not None:
        message.parts.add(media=serving_pb2.Media(mime_type="image/png", data=image))
    message.parts.add(text=text)
    return request


def generate(daemon, request):
    return read_reply(daemon.stub.Generate(request, timeout=120))


@pytest.mark.parametrize("path", LLAVA_GOLDEN, ids=lambda path: path.stem)
def test_golden_image_refusal(served, path):
    header, request_text = read_golden(path)
    reply = generate(served, text_format.Parse(request_text, serving_pb2.GenerateRequest()))
    assert (reply.code.name, reply.details) == (header["code"], header["message"])


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    question = "what is in this picture, the quick brown fox or the lazy dog?"
    first = generate(served, ask(block_image(21), question))
    again = generate(served, ask(block_image(21), question))
    other = generate(served, ask(block_image(22), question))
    assert first.ok and again.ok and other.ok
    image_end = 3 + TOKENS_PER_IMAGE  # "<|im_start|>user\n" then the image
    assert again.last.usage.cached_tokens >= image_end  # the hit covers the image's positions
    assert again.token_ids == first.token_ids
    assert other.last.usage.cached_tokens < image_end - TOKENS_PER_IMAGE + 1  # at most the text before it
    assert other.token_ids != first.token_ids


def test_replies_beside_images_equal_their_solo_runs(served):
    requests = [
        ask(block_image(31)),
        ask(None, "hello world"),
        ask(block_image(32), "the lazy dog", temperature=0.9, seed=7),
        ask(block_image(31), "the quick brown fox"),
        ask(None, "tensor parallel serving", temperature=1.1, seed=3),
    ]
    solo = [generate(served, request) for request in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda request: generate(served, request), requests))
    assert all(reply.ok and len(reply.token_ids) == MAX_TOKENS for reply in solo + together)
    assert [reply.token_ids for reply in together] == [reply.token_ids for reply in solo]


def test_an_image_over_http_is_a_data_url_and_reads_as_over_grpc(served):
    image = block_image(41, fmt="WEBP")
    url = "data:image/webp;base64," + base64.b64encode(image).decode()
    body = {
        "model": served.model_name,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "what"},
                ],
            }
        ],
    }
    response = httpx.post(f"{served.http_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    request = ask(None, "what")
    request.messages[0].parts.insert(
        0, serving_pb2.ContentPart(media=serving_pb2.Media(mime_type="image/webp", data=image))
    )
    assert response.json()["choices"][0]["message"]["content"] == generate(served, request).text
    body["messages"][0]["content"][0]["image_url"]["url"] = "https://example.com/cat.png"
    refused = httpx.post(f"{served.http_url}/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "fetches none" in refused.json()["error"]["message"]


def test_fuzzed_image_bytes_fail_their_own_request_only(served):
    rng = random.Random(5)
    good = block_image(51, (30, 30))
    for _ in range(40):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(1, len(data))]
        reply = generate(served, ask(bytes(data)))
        assert reply.ok or reply.code == grpc.StatusCode.INVALID_ARGUMENT, reply.details
    assert served.health() == health_pb2.HealthCheckResponse.SERVING
    assert generate(served, ask(good)).ok


def test_without_vision_a_llava_serves_text_and_refuses_images_as_before(model_dir, tmp_path):
    with running_daemon("spawn", model_dir, tmp_path / "logs", "--context", "256") as daemon:
        assert generate(daemon, ask(None, "hello world")).ok
        refused = generate(daemon, ask(block_image(61)))
    assert (refused.code, refused.details) == (grpc.StatusCode.FAILED_PRECONDITION, VISION_NEEDED)

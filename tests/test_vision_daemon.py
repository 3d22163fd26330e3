"""--vision through the real two-rank daemon on a tiny LLaVA: image parts over gRPC and HTTP, every
image refusal word for word, fuzzed image bytes, the prompt cache across images, and replies that
equal their solo runs whether or not images sit beside them."""

from __future__ import annotations

import base64
import io
import socket
from contextlib import closing
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from daemon import BackgroundReply, running_daemon
from google.protobuf import text_format
from grpc_health.v1 import health_pb2
from PIL import Image
from test_grpc_api import GOLDEN_DIR, LLAVA_LIMITS, read_golden
from tiny_llava import TOKENS_PER_IMAGE, block_image, write_tiny_llava
from vision_requests import MAX_TOKENS, VISION_ARGS, ask, check_batched, corrupted, generate, same_then_other

from tpserve.server.validation import VISION_NEEDED
from tpserve.v1 import serving_pb2

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
    args = (*VISION_ARGS, *limits)
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("llava-logs"), *args) as daemon:
        daemon.model_name = Path(model_dir).name
        yield daemon


@pytest.mark.parametrize("path", LLAVA_GOLDEN, ids=lambda path: path.stem)
def test_golden_image_refusal(served, path):
    header, request_text = read_golden(path)
    reply = generate(served, text_format.Parse(request_text, serving_pb2.GenerateRequest()))
    assert (reply.code.name, reply.details) == (header["code"], header["message"])


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    again, other = same_then_other(served, (40, 34))  # block_image's own default size
    image_end = 3 + TOKENS_PER_IMAGE  # "<|im_start|>user\n" then the image
    assert again.last.usage.cached_tokens >= image_end  # the hit covers the image's positions
    assert other.last.usage.cached_tokens < image_end - TOKENS_PER_IMAGE + 1  # at most the text before it


def test_replies_beside_images_equal_their_solo_runs(served):
    requests = [
        ask(block_image(31)),
        ask(None, "hello world"),
        ask(block_image(32), "the lazy dog", temperature=0.9, seed=7),
        ask(block_image(31), "the quick brown fox"),
        ask(None, "tensor parallel serving", temperature=1.1, seed=3),
    ]
    check_batched(served, requests)


def test_an_image_over_http_is_a_data_url_and_reads_as_over_grpc(served):
    image = block_image(41, fmt="WEBP")
    url = "data:image/webp;base64," + base64.b64encode(image).decode()
    body = {
        "model": served.model_name,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,  # gRPC's unset
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
    good = block_image(51, (30, 30))
    for data in corrupted(good, 40):
        reply = generate(served, ask(data))
        assert reply.ok or reply.code == grpc.StatusCode.INVALID_ARGUMENT, reply.details
    assert served.health() == health_pb2.HealthCheckResponse.SERVING
    assert generate(served, ask(good)).ok


def test_without_vision_a_llava_serves_text_and_refuses_images_as_before(model_dir, tmp_path):
    with running_daemon("spawn", model_dir, tmp_path / "logs", "--context", "256") as daemon:
        assert generate(daemon, ask(None, "hello world")).ok
        refused = generate(daemon, ask(block_image(61)))
    assert (refused.code, refused.details) == (grpc.StatusCode.FAILED_PRECONDITION, VISION_NEEDED)


def chat_with_image(served, image: bytes, text: str = "what") -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {
        "model": served.model_name,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,  # greedy, as gRPC's unset temperature
        "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }


def test_an_http_image_over_max_image_bytes_is_a_400_naming_the_limit_and_serving_goes_on(served):
    image = block_image(71, (30, 30)) + bytes(LLAVA_LIMITS["max_image_bytes"])  # a PNG reads past its end
    response = httpx.post(
        f"{served.http_url}/chat/completions", json=chat_with_image(served, image), timeout=60
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == (
        f"messages[0].parts[0].media.data is {len(image)} bytes; the most per image is "
        f"{LLAVA_LIMITS['max_image_bytes']}"
    )
    assert error["type"] == "invalid_request_error"
    small = chat_with_image(served, block_image(71, (30, 30)))
    assert httpx.post(f"{served.http_url}/chat/completions", json=small, timeout=60).status_code == 200
    assert served.health() == health_pb2.HealthCheckResponse.SERVING


def noise_png(size: tuple[int, int], seed: int) -> bytes:
    """An image of `size` stored uncompressed: about width x height x 3 bytes."""
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed))
    out = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy(), "RGB").save(out, format="PNG", compress_level=0)
    return out.getvalue()


def test_an_image_the_limits_allow_is_not_refused_by_the_transport_first(model_dir, tmp_path):
    """A 4.3 MB photo under max_image_bytes was refused by the transports' own 4 MiB limits first
    (HTTP 413, gRPC RESOURCE_EXHAUSTED); they now fit every image the limits allow
    (tpserve/server/request_size.py), and the image limit is the one a larger image hears about."""
    limit = 5_000_000
    args = (*VISION_ARGS, "--max-images", "1", "--max-image-bytes", str(limit))
    image = noise_png((1200, 1200), seed=81)
    assert 4 << 20 < len(image) < limit
    too_large = image + bytes(limit - len(image) + 1)
    with running_daemon("spawn", model_dir, tmp_path / "logs", *args) as daemon:
        daemon.model_name = Path(model_dir).name
        url = f"{daemon.http_url}/chat/completions"
        response = httpx.post(url, json=chat_with_image(daemon, image), timeout=120)
        over_grpc = generate(daemon, ask(image, "what"))
        refused_http = httpx.post(url, json=chat_with_image(daemon, too_large), timeout=120)
        refused_grpc = generate(daemon, ask(too_large, "what"))
        again = generate(daemon, ask(image, "what"))
    assert response.status_code == 200, response.text
    assert over_grpc.ok, (over_grpc.code, over_grpc.details)
    assert response.json()["choices"][0]["message"]["content"] == over_grpc.text == again.text
    expected = f"messages[0].parts[0].media.data is {len(too_large)} bytes; the most per image is {limit}"
    assert (refused_http.status_code, refused_http.json()["error"]["message"]) == (400, expected)
    assert (refused_grpc.code, refused_grpc.details) == (grpc.StatusCode.INVALID_ARGUMENT, expected)


def chat_with_url(served, url: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what"}]
    return {
        "model": served.model_name,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": content}],
    }


def ask_url(url: str) -> serving_pb2.GenerateRequest:
    """ask's chat with an image given by its URL (gRPC's Media.url) before the text."""
    request = ask(None, "what")
    media = serving_pb2.Media(mime_type="image/*", url=url)
    request.messages[0].parts.insert(0, serving_pb2.ContentPart(media=media))
    return request


def test_an_allowed_host_resolving_to_loopback_fails_its_own_request_only(model_dir, tmp_path):
    """allowed_media_domains names localhost: its URL is refused as a loopback address before any
    connection (the listener behind it is never reached), over HTTP (chat and /tokenize) and over
    gRPC (Media.url in Generate and Tokenize) in the same words, while a reply in flight runs to its
    end (whenever the refusals land in it: no test of speed); http:// is refused by name on both,
    and a gRPC URL sent as data, which is never fetched, keeps its wording."""
    args = (*VISION_ARGS, "--allowed-media-domains", "localhost", "--media-fetch-timeout-s", "5")
    with (
        closing(socket.socket()) as listener,
        running_daemon("spawn", model_dir, tmp_path / "logs", *args) as daemon,
    ):
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        daemon.model_name = Path(model_dir).name
        url = f"https://localhost:{listener.getsockname()[1]}/cat.png"
        long = ask(None, "hi")
        long.max_tokens = 200
        in_flight = BackgroundReply(daemon.stub, long, timeout_s=120)
        in_flight.wait_tokens(1)
        refused = httpx.post(
            f"{daemon.http_url}/chat/completions", json=chat_with_url(daemon, url), timeout=60
        )
        tokenize_body = {"messages": chat_with_url(daemon, url)["messages"]}
        tokenize = httpx.post(
            f"{daemon.http_url.removesuffix('/v1')}/tokenize", json=tokenize_body, timeout=60
        )
        plain = httpx.post(
            f"{daemon.http_url}/chat/completions",
            json=chat_with_url(daemon, url.replace("https", "http")),
            timeout=60,
        )
        grpc_loopback = generate(daemon, ask_url(url))
        grpc_plain = generate(daemon, ask_url(url.replace("https", "http")))
        with pytest.raises(grpc.RpcError) as grpc_tokenize:
            tokenize_request = serving_pb2.TokenizeRequest(messages=ask_url(url).messages)
            daemon.stub.Tokenize(tokenize_request, timeout=60)
        as_data = ask(None, "what")
        as_data.messages[0].parts.insert(
            0, serving_pb2.ContentPart(media=serving_pb2.Media(mime_type="image/*", data=url.encode()))
        )
        grpc_refused = generate(daemon, as_data)
        finished = in_flight.join(120)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing waits to be accepted: no connection was made
            listener.accept()
        assert daemon.health() == health_pb2.HealthCheckResponse.SERVING
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"] == (
        "messages[0].parts[0].media: the host 'localhost' resolves to 127.0.0.1, a loopback address; "
        "media is fetched from public addresses only"
    )
    assert (tokenize.status_code, tokenize.json()["error"]["message"]) == (
        400,
        refused.json()["error"]["message"],
    )
    assert finished.ok and len(finished.token_ids) == 200, (finished.code, finished.details)
    assert (plain.status_code, plain.json()["error"]["message"]) == (
        400,
        "messages[0].parts[0].media: http:// URLs are not fetched, only https:// ones",
    )
    assert grpc_refused.code == grpc.StatusCode.INVALID_ARGUMENT and "fetches none" in grpc_refused.details
    loopback = (grpc.StatusCode.INVALID_ARGUMENT, refused.json()["error"]["message"])
    assert (grpc_loopback.code, grpc_loopback.details) == loopback
    assert (grpc_tokenize.value.code(), grpc_tokenize.value.details()) == loopback
    assert (grpc_plain.code, grpc_plain.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        plain.json()["error"]["message"],
    )

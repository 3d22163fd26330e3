"""--vision through the real two-rank daemon on a tiny SmolVLM that transformers writes
(tests/tiny_idefics3.py): a chat with an image gives transformers' own greedy tokens (its tiles and
global image cut by prompt passes and cache blocks of 16); the same image hits the prompt cache and
repeats the cold reply, another never does; replies beside images equal their solo runs; an image over
HTTP as a data: URL reads as over gRPC, cold and from the cache; broken image bytes fail their own
request only (400 over HTTP, INVALID_ARGUMENT over gRPC); a video part is refused by name."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from daemon import running_daemon
from grpc_health.v1 import health_pb2
from PIL import Image
from tiny_idefics3 import ARCHITECTURES, write_tiny_idefics3
from tiny_llava import block_image
from vision_requests import (
    MAX_TOKENS,
    VISION_ARGS,
    ask,
    check_beside_images,
    check_cache_across_images,
    check_transformers_greedy,
    corrupted,
    generate,
)

from tpserve.server.tokenizer import Tokenizer
from tpserve.v1 import serving_pb2

SIZE = (70, 50)  # 3x3 tiles and the global image: 40 image positions among 62


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_tiny_idefics3(tmp_path_factory.mktemp("smolvlm-model"), architecture=ARCHITECTURES[1])
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("smolvlm-logs"), *VISION_ARGS) as daemon:
        daemon.model_dir, daemon.model_name = model_dir, Path(model_dir).name
        yield daemon


def transformers_greedy(model_dir: str, image: bytes, text: str) -> list[int]:
    """transformers' own greedy reply to the same chat: Idefics3Processor's prompt and pixels."""
    from transformers import AutoModelForImageTextToText, Idefics3Processor

    processor = Idefics3Processor.from_pretrained(model_dir)
    content = [{"type": "image"}, {"type": "text", "text": text}]
    rendered = Tokenizer.from_model_dir(model_dir).render_chat([{"role": "user", "content": content}])
    inputs = processor(text=rendered, images=[[Image.open(io.BytesIO(image))]], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_an_image_chat_gives_transformers_greedy_tokens(served):
    check_transformers_greedy(served, SIZE, 62, transformers_greedy)


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    check_cache_across_images(served, SIZE, 3 + 62)  # "<|im_start|>user\n" then the whole image


def test_replies_beside_images_equal_their_solo_runs(served):
    check_beside_images(served, SIZE, (40, 90))


def chat_body(served, part: dict, text: str = "what") -> dict:
    return {
        "model": served.model_name,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,  # greedy, as gRPC's unset temperature
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
    }


def image_url(data: bytes, mime: str = "image/png") -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()},
    }


def test_an_image_over_http_is_a_data_url_and_reads_as_over_grpc_cold_and_cached(served):
    image = block_image(41, (33, 31))
    url = f"{served.http_url}/chat/completions"
    cold = httpx.post(url, json=chat_body(served, image_url(image)), timeout=60)
    cached = httpx.post(url, json=chat_body(served, image_url(image)), timeout=60)
    assert cold.status_code == cached.status_code == 200, cold.text
    assert cached.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    over_grpc = generate(served, ask(image, "what"))
    texts = [response.json()["choices"][0]["message"]["content"] for response in (cold, cached)]
    assert texts == [over_grpc.text] * 2
    assert cold.json()["usage"]["prompt_tokens"] == over_grpc.last.usage.prompt_tokens


def test_broken_image_bytes_fail_their_own_request_only(served):
    good = block_image(51, SIZE)
    url = f"{served.http_url}/chat/completions"
    refused = 0
    for data in corrupted(good, 16):
        reply = generate(served, ask(data))
        assert reply.ok or reply.code == grpc.StatusCode.INVALID_ARGUMENT, reply.details
        response = httpx.post(url, json=chat_body(served, image_url(data)), timeout=60)
        assert response.status_code == (200 if reply.ok else 400), response.text
        refused += not reply.ok
    assert refused  # some copies were unreadable
    response = httpx.post(url, json=chat_body(served, image_url(b"not an image")), timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "messages[0].parts[0].media.data is not a readable JPEG, PNG or WebP image"
    )
    assert served.health() == health_pb2.HealthCheckResponse.SERVING
    assert generate(served, ask(good)).ok


def test_a_video_part_is_refused_by_name_over_grpc_and_http(served):
    expected = "messages[0].parts[0].media: this model's video input is not implemented (send the video's frames as images)"
    request = ask(None, "what")
    video = serving_pb2.Media(mime_type="video/mp4", data=b"\x00\x00\x00\x18ftypmp42")
    request.messages[0].parts.insert(0, serving_pb2.ContentPart(media=video))
    reply = generate(served, request)
    assert (reply.code, reply.details) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
    part = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(video.data).decode()},
    }
    response = httpx.post(f"{served.http_url}/chat/completions", json=chat_body(served, part), timeout=60)
    assert (response.status_code, response.json()["error"]["message"]) == (400, expected)
    assert generate(served, ask(block_image(61, SIZE))).ok

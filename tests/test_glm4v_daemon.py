"""--vision through the real two-rank daemon on a tiny GLM-4.1V, and a tiny GLM-4.5V, that transformers
writes (tests/tiny_glm4v.py): a chat with an image gives transformers' own greedy tokens on Glm4vProcessor's
prompt, in prompt passes and cache blocks of 16 that cut the image; a second turn over the first one's
cached prefix gives transformers' greedy tokens for the whole conversation, and the same request again
(from the cache) repeats it; an image over HTTP as a data: URL reads as over gRPC; replies beside
images equal their solo runs; broken image bytes fail their own request only; a chat with a short MP4
(each temporal patch apart, then its time) gives transformers' greedy tokens, cold and from the cache;
a WebM over HTTP reads as over gRPC; broken video bytes fail their own request only."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import vision_requests
from daemon import running_daemon
from jinja2 import Template
from PIL import Image
from test_glm4v_video import MESSAGES, ours, sampled, transformers_prompt, video_input
from tiny_glm4v import CHAT_TEMPLATE, glm4v_processor, write_tiny_glm4v
from tiny_llava import block_image
from tiny_video import MIME_TYPES, block_video
from vision_requests import (
    MAX_TOKENS,
    VISION_ARGS,
    ask,
    check_batched,
    check_broken,
    check_broken_and_sliver_images,
    generate,
    http_chat,
    same_then_other,
)
from vl_checks import greedy_generate

from tpserve.v1 import serving_pb2

NUM_FRAMES, FPS = 10, 4  # 2.5 s: 5 frames sampled at 2 a second, 3 temporal patches
SIZE = (100, 70)  # resized to 96x64 (both frames within the pixel bound): an 8x12 patch grid, 24 positions


@pytest.fixture(scope="module", params=["glm4v", "glm4v_moe"])
def served(request, tmp_path_factory):
    moe = request.param == "glm4v_moe"
    model_dir = write_tiny_glm4v(tmp_path_factory.mktemp(f"{request.param}-model"), moe=moe)
    logs = tmp_path_factory.mktemp(f"{request.param}-logs")
    with running_daemon("spawn", model_dir, logs, *VISION_ARGS) as daemon:
        daemon.model_dir, daemon.model_name, daemon.moe = model_dir, Path(model_dir).name, moe
        yield daemon


def reference(served):
    """transformers' own model of the served checkpoint (a mixture's experts eager: its grouped product
    wants widths of 16s)."""
    import transformers

    kind = "Glm4vMoeForConditionalGeneration" if served.moe else "Glm4vForConditionalGeneration"
    eager = {"experts_implementation": "eager"} if served.moe else {}
    return getattr(transformers, kind).from_pretrained(served.model_dir, dtype=torch.float32, **eager).eval()


def transformers_greedy(served, image: bytes, messages: list[dict]) -> list[int]:
    """transformers' own greedy reply to the chat: the template, then Glm4vProcessor's prompt (the image
    token widened to its merged grid), pixels and token types."""
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    inputs = glm4v_processor(served.model_dir)(
        text=[rendered], images=[Image.open(io.BytesIO(image))], return_tensors="pt"
    )
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    return greedy_generate(reference(served), ids, MAX_TOKENS, **inputs)


def image_message(text: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def test_an_image_chat_and_its_second_turn_give_transformers_greedy_tokens(served):
    image, text = block_image(11, SIZE), "what is in this picture"
    first = generate(served, ask(image, text))
    assert first.ok, first.details
    assert first.last.usage.prompt_tokens > 24  # the image's positions, cut by passes of 16
    assert first.token_ids == transformers_greedy(served, image, [image_message(text)])
    # The second turn: the first one's prompt (the image in it) comes from the cache.
    follow_up = "the quick brown fox"
    request = ask(image, text)
    request.messages.add(role="assistant").parts.add(text=first.text)
    request.messages.add(role="user").parts.add(text=follow_up)
    second = generate(served, request)
    assert second.ok, second.details
    assert second.last.usage.cached_tokens >= 24
    conversation = [
        image_message(text),
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": follow_up},
    ]
    assert second.token_ids == transformers_greedy(served, image, conversation)
    again = generate(served, request)  # now its whole prompt but the last block is cached
    assert again.token_ids == second.token_ids
    assert again.last.usage.cached_tokens > second.last.usage.cached_tokens


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    again, other = same_then_other(served, SIZE)
    image_end = 4 + 24  # "<|im_start|>user\n<|begin_of_image|>" then the image
    assert again.last.usage.cached_tokens >= image_end  # the hit covers the image's positions
    assert other.last.usage.cached_tokens < 16  # at most the block of text before it


def test_an_image_over_http_is_a_data_url_and_reads_as_over_grpc(served):
    image = block_image(12, (70, 50))
    response = http_chat(served, "image", "image/png", image)
    assert response.status_code == 200, response.text
    grpc_reply = generate(served, ask(image, "what"))
    assert grpc_reply.ok and response.json()["choices"][0]["message"]["content"] == grpc_reply.text
    assert response.json()["usage"]["prompt_tokens"] == grpc_reply.last.usage.prompt_tokens


def test_replies_beside_images_equal_their_solo_runs(served):
    requests = [
        ask(block_image(31, SIZE)),
        ask(None, "hello world"),
        ask(block_image(32, (40, 90)), "the lazy dog", temperature=0.9, seed=7),
        ask(block_image(31, SIZE), "the quick brown fox"),
    ]
    check_batched(served, requests)


def test_broken_and_sliver_images_fail_their_own_request_only(served):
    check_broken_and_sliver_images(served, block_image(51, SIZE))


def transformers_video_greedy(served, video: bytes) -> list[int]:
    """transformers' own greedy reply to MESSAGES with the video: Glm4vProcessor's prompt (each temporal
    patch apart, then its time), the same frames' pixels, the processor's token types."""
    _, _, plan, patches, grid = ours(video_input(served.model_dir, "<|image|>"), served.model_dir, video)
    ids = transformers_prompt(served.model_dir, grid, sampled(NUM_FRAMES, float(FPS)), float(FPS))
    types = glm4v_processor(served.model_dir).create_mm_token_type_ids([ids])
    return greedy_generate(
        reference(served),
        ids,
        MAX_TOKENS,
        pixel_values_videos=torch.from_numpy(np.ascontiguousarray(patches)),
        video_grid_thw=torch.tensor([grid]),
        mm_token_type_ids=torch.tensor(types),
    )


def ask_video(video: bytes, fmt: str = "mp4") -> serving_pb2.GenerateRequest:
    return vision_requests.ask_video(video, MESSAGES[0]["content"][1]["text"], fmt)


def test_a_video_chat_gives_transformers_greedy_tokens_and_hits_the_cache_again(served):
    video = block_video(3, NUM_FRAMES, (40, 34), fps=FPS)
    reply = generate(served, ask_video(video))
    assert reply.ok, reply.details
    assert reply.token_ids == transformers_video_greedy(served, video)
    again = generate(served, ask_video(video))
    assert again.token_ids == reply.token_ids
    assert again.last.usage.cached_tokens >= 16  # past the first patch's tokens, in whole blocks of 16


def test_a_webm_over_http_is_a_data_url_and_reads_as_over_grpc(served):
    video = block_video(12, NUM_FRAMES, (36, 24), fps=FPS, fmt="webm")
    response = http_chat(served, "video", MIME_TYPES["webm"], video, MESSAGES[0]["content"][1]["text"])
    assert response.status_code == 200, response.text
    grpc_reply = generate(served, ask_video(video, fmt="webm"))
    assert grpc_reply.ok and response.json()["choices"][0]["message"]["content"] == grpc_reply.text
    assert response.json()["usage"]["prompt_tokens"] == grpc_reply.last.usage.prompt_tokens


def test_broken_video_bytes_fail_their_own_request_only(served):
    check_broken(served, block_video(4, NUM_FRAMES, (40, 34), fps=FPS), ask_video, 12)

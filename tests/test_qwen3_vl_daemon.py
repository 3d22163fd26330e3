"""--vision through the real two-rank daemon on a tiny Qwen3-VL that transformers writes: a chat with
an image gives transformers' own greedy tokens, in prompt passes and cache blocks of 16 that cut the
image (its deepstack rows cut with it); the same image hits the prompt cache and repeats the cold reply,
another never does; replies beside images equal their solo runs; a video part fails its own request,
naming what is not built, while the server serves on."""

from __future__ import annotations

import io
from pathlib import Path

import grpc
import pytest
import torch
from daemon import running_daemon
from grpc_health.v1 import health_pb2
from jinja2 import Template
from PIL import Image
from tiny_llava import block_image
from tiny_qwen3_vl import MERGE, write_tiny_qwen3_vl
from tiny_qwen_vl import CHAT_TEMPLATE, IMAGE_TOKEN_ID
from tiny_video import block_video
from tokenizers import Tokenizer
from vision_requests import MAX_TOKENS, VISION_ARGS, ask, check_batched, generate, same_then_other

from tpserve.v1 import serving_pb2

SIZE = (130, 100)  # resized to 128x96: a 16x12 patch grid of 8 pixels, 48 image positions


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl-model"))
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("qwen3-vl-logs"), *VISION_ARGS) as daemon:
        daemon.model_dir = model_dir
        yield daemon


def transformers_greedy(model_dir: str, image: bytes, text: str) -> list[int]:
    """transformers' own greedy reply to the same chat: the template, the image pad widened to its
    merged grid, the processor's pixels."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

    inputs = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(
        images=Image.open(io.BytesIO(image)), return_tensors="pt"
    )
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    at = ids.index(IMAGE_TOKEN_ID)
    num = int(inputs["image_grid_thw"][0].prod()) // MERGE**2
    ids = torch.tensor([ids[:at] + [IMAGE_TOKEN_ID] * num + ids[at + 1 :]])
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, ids.shape[1] :].tolist()


def test_an_image_chat_gives_transformers_greedy_tokens(served):
    image, text = block_image(11, SIZE), "what is in this picture"
    reply = generate(served, ask(image, text))
    assert reply.ok, reply.details
    assert reply.last.usage.prompt_tokens > 48  # the image's positions, cut by passes of 16
    assert reply.token_ids == transformers_greedy(served.model_dir, image, text)


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    again, other = same_then_other(served, SIZE)
    image_end = 4 + 48  # "<|im_start|>user\n<|vision_start|>" then the image
    assert again.last.usage.cached_tokens >= image_end  # the hit covers the image's positions
    assert other.last.usage.cached_tokens < 16  # at most the block of text before it


def test_replies_beside_images_equal_their_solo_runs(served):
    requests = [
        ask(block_image(31, SIZE)),
        ask(None, "hello world"),
        ask(block_image(32, (40, 90)), "the lazy dog", temperature=0.9, seed=7),
        ask(block_image(31, SIZE), "the quick brown fox"),
    ]
    check_batched(served, requests)


def test_a_video_part_fails_its_own_request_naming_what_is_not_built(served):
    request = ask(None, "what happens in this video")
    video = serving_pb2.Media(mime_type="video/mp4", data=block_video(3, 4, (32, 32)))
    request.messages[0].parts.insert(0, serving_pb2.ContentPart(media=video))
    refused = generate(served, request)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Qwen3-VL's timestamped video frames are not implemented" in refused.details
    assert served.health() == health_pb2.HealthCheckResponse.SERVING
    assert generate(served, ask(block_image(41, SIZE))).ok

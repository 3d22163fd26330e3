"""--vision through the real two-rank daemon on a tiny Qwen3-VL that transformers writes: a chat with
an image gives transformers' own greedy tokens, in prompt passes and cache blocks of 16 that cut the
image (its deepstack rows cut with it); the same image hits the prompt cache and repeats the cold reply,
another never does; replies beside images equal their solo runs; a chat with a short MP4 (each temporal
patch after its time in text) gives transformers' greedy tokens, cold and from the cache; broken video
bytes fail their own request only; a WebM over HTTP as a data: URL reads as over gRPC."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import pytest
import torch
import vision_requests
from daemon import running_daemon
from jinja2 import Template
from PIL import Image
from test_qwen3_vl_video import MESSAGES, ours, transformers_prompt, video_input
from tiny_qwen3_vl import MERGE, write_tiny_qwen3_vl
from tiny_qwen_vl import CHAT_TEMPLATE, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID
from tiny_video import block_video
from tokenizers import Tokenizer as RawTokenizer
from vision_requests import (
    MAX_TOKENS,
    VISION_ARGS,
    check_beside_images,
    check_broken,
    check_cache_across_images,
    check_transformers_greedy,
    generate,
)
from vl_checks import greedy_generate

from tpserve.v1 import serving_pb2

NUM_FRAMES, FPS = 10, 4  # 2.5 s: 5 frames sampled at 2 a second, 3 temporal patches
SIZE = (130, 100)  # resized to 128x96: a 16x12 patch grid of 8 pixels, 48 image positions


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl-model"))
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("qwen3-vl-logs"), *VISION_ARGS) as daemon:
        daemon.model_dir, daemon.model_name = model_dir, Path(model_dir).name
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
    tokenizer = RawTokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
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
    check_transformers_greedy(served, SIZE, 48, transformers_greedy)


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    check_cache_across_images(served, SIZE, 4 + 48)  # "<|im_start|>user\n<|vision_start|>" then the image


def test_replies_beside_images_equal_their_solo_runs(served):
    check_beside_images(served, SIZE, (40, 90))


def transformers_video_greedy(model_dir: str, video: bytes) -> list[int]:
    """transformers' own greedy reply to MESSAGES with the video: Qwen3VLProcessor's prompt (each
    temporal patch after its time), the same frames' pixels."""
    from transformers import Qwen3VLForConditionalGeneration

    _, _, plan, patches, grid = ours(video_input(model_dir, "<|image_pad|>"), model_dir, video)
    ids = transformers_prompt(model_dir, plan, grid, NUM_FRAMES, FPS)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return greedy_generate(
        model,
        ids,
        MAX_TOKENS,
        pixel_values_videos=torch.from_numpy(patches),
        video_grid_thw=torch.tensor([grid]),
        mm_token_type_ids=(torch.tensor([ids]) == VIDEO_TOKEN_ID).int() * 2,
    )


def ask_video(video: bytes, fmt: str = "mp4") -> serving_pb2.GenerateRequest:
    return vision_requests.ask_video(video, MESSAGES[0]["content"][1]["text"], fmt)


def test_a_video_chat_gives_transformers_greedy_tokens_and_hits_the_cache_again(served):
    video = block_video(3, NUM_FRAMES, (40, 34), fps=FPS)
    reply = generate(served, ask_video(video))
    assert reply.ok, reply.details
    assert reply.token_ids == transformers_video_greedy(served.model_dir, video)
    again = generate(served, ask_video(video))
    assert again.token_ids == reply.token_ids
    assert again.last.usage.cached_tokens >= 16  # past the first patch's pads, in whole blocks of 16


def test_a_webm_over_http_is_a_data_url_and_reads_as_over_grpc(served):
    video = block_video(12, NUM_FRAMES, (36, 24), fps=FPS, fmt="webm")
    url = "data:video/webm;base64," + base64.b64encode(video).decode()
    text = MESSAGES[0]["content"][1]["text"]
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]
    body = {
        "model": served.model_name,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,  # gRPC's unset
        "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }
    response = httpx.post(f"{served.http_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    grpc_reply = generate(served, ask_video(video, fmt="webm"))
    assert grpc_reply.ok and response.json()["choices"][0]["message"]["content"] == grpc_reply.text
    assert response.json()["usage"]["prompt_tokens"] == grpc_reply.last.usage.prompt_tokens


def test_broken_video_bytes_fail_their_own_request_only(served):
    check_broken(served, block_video(4, NUM_FRAMES, (40, 34), fps=FPS), ask_video, 12)

"""Video inputs through the real two-rank daemon on a tiny Qwen2.5-VL: a chat with a short MP4 (and a
WebM over HTTP as a data: URL) gives transformers' own greedy tokens, in prompt passes and cache
blocks of 16 that cut the video; the same video hits the prompt cache and another never does;
fuzzed bytes fail their own request only, and each video limit refuses by name, while a stream
beside them runs on unchanged."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from daemon import running_daemon
from grpc_health.v1 import health_pb2
from jinja2 import Template
from test_qwen_vl_video import ours, transformers_inputs
from tiny_qwen_vl import CHAT_TEMPLATE, MERGE, VIDEO_TOKEN_ID, write_tiny_qwen_vl
from tiny_video import block_video
from tokenizers import Tokenizer
from vision_requests import MAX_TOKENS, VISION_ARGS, ask, ask_video, corrupted, generate

# Small limits, so each can be passed cheaply.
LIMITS = {"max_video_bytes": 20000, "max_video_seconds": 5, "max_video_frames": 30, "max_video_pixels": 4096}
SIZE = (40, 34)  # frames resized to 36x36: a 6x6 patch grid, 9 positions a temporal patch


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_tiny_qwen_vl(tmp_path_factory.mktemp("qwen-vl-video-model"))
    limits = (x for key, value in LIMITS.items() for x in (f"--{key.replace('_', '-')}", str(value)))
    with running_daemon(
        "spawn", model_dir, tmp_path_factory.mktemp("qwen-vl-video-logs"), *VISION_ARGS, *limits
    ) as daemon:
        daemon.model_dir, daemon.model_name = model_dir, Path(model_dir).name
        yield daemon


def transformers_greedy(model_dir: str, video: bytes, text: str, tmp_path: Path) -> list[int]:
    """transformers' own greedy reply to the same chat: the template, the video pad widened to its
    merged grid, the frames' pixels and second_per_grid_ts."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    plan, _, _ = ours(model_dir, video)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    at = ids.index(VIDEO_TOKEN_ID)
    num = plan.grid[0] * plan.grid[1] * plan.grid[2] // MERGE**2
    inputs = transformers_inputs(
        model_dir, video, ids[:at] + [VIDEO_TOKEN_ID] * num + ids[at + 1 :], tmp_path
    )
    ids = inputs["input_ids"]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, ids.shape[1] :].tolist()


def test_a_video_chat_gives_transformers_greedy_tokens(served, tmp_path):
    video, text = block_video(11, 10, SIZE), "what is in this video"
    reply = generate(served, ask_video(video, text))
    assert reply.ok, reply.details
    assert reply.token_ids == transformers_greedy(served.model_dir, video, text, tmp_path)


def test_a_webm_over_http_is_a_data_url_and_reads_as_over_grpc(served):
    video = block_video(12, 10, SIZE, fmt="webm")
    url = "data:video/webm;base64," + base64.b64encode(video).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what"}]
    body = {
        "model": served.model_name,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,  # gRPC's unset
        "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }
    response = httpx.post(f"{served.http_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    grpc_reply = generate(served, ask_video(video, "what", fmt="webm"))
    assert response.json()["choices"][0]["message"]["content"] == grpc_reply.text
    content[0]["video_url"]["url"] = "https://example.com/cat.mp4"
    refused = httpx.post(f"{served.http_url}/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "fetches none" in refused.json()["error"]["message"]


def test_the_same_video_reuses_its_cache_entry_and_another_video_never_does(served):
    question = "what is in this video, the quick brown fox or the lazy dog?"
    replies = []
    videos = {seed: block_video(seed, 10, SIZE) for seed in (21, 22)}  # one bytes object per video
    for seed in (21, 21, 22):
        replies.append(generate(served, ask_video(videos[seed], question)))
        served.wait_idle()  # the reply's lane released, its blocks in the cache
    first, again, other = replies
    assert first.ok and again.ok and other.ok
    assert again.token_ids == first.token_ids and other.token_ids != first.token_ids
    video_end = 4 + 18  # "<|im_start|>user\n<|vision_start|>" then 2 temporal patches of 3x3
    assert again.last.usage.cached_tokens >= video_end
    assert other.last.usage.cached_tokens < 16  # at most the block of text before it


def test_fuzzed_and_oversized_videos_fail_their_own_request_naming_the_limit(served):
    beside = ask(None, "the quick brown fox")
    beside.max_tokens = 40
    alone = generate(served, beside)
    good = block_video(31, 10, SIZE)
    oversized = {
        "max_video_bytes": good + bytes(LIMITS["max_video_bytes"]),
        "max_video_pixels": block_video(32, 4, (72, 72)),
        "max_video_seconds": block_video(33, 24, (24, 24), fps=4),  # 6 s
        "max_video_frames": block_video(34, 40, (24, 24), fps=10),  # 4 s
    }
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(generate, served, beside)  # a stream that runs through all of it
        for data in corrupted(good, 20):
            reply = generate(served, ask_video(data))
            assert reply.ok or reply.code == grpc.StatusCode.INVALID_ARGUMENT, reply.details
        for limit, data in oversized.items():
            refused = generate(served, ask_video(data))
            assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and limit in refused.details, (
                refused.details
            )
        assert running.result().token_ids == alone.token_ids
    assert served.health() == health_pb2.HealthCheckResponse.SERVING
    assert generate(served, ask_video(good)).ok
    served.wait_idle()  # every lane back

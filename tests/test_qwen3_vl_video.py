"""Qwen3-VL video below the server, on the tiny random Qwen3-VL (tests/tiny_qwen3_vl.py) and short videos
PyAV makes here: the frames sampled, the clip's size and each temporal patch's time against
transformers' own Qwen3VLVideoProcessor.sample_frames, smart_resize and Qwen3VLProcessor's timestamps;
the prompt (each patch apart, after its time in text) against Qwen3VLProcessor.replace_video_token's
text through the tokenizer; logits and greedy tokens against transformers' forward on the same
pixel_values_videos; tp=2 against tp=1 bit for bit. (transformers' video processor itself needs
torchvision, which has no build for this torch here: the pixels are ours on both sides.)"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from hf_reference import cached_greedy
from jinja2 import Template
from multiproc import RankPool, world_collectives
from test_tp_exact import decode_steps
from tiny_qwen3_vl import MERGE, TEMPORAL, VIDEO_PROCESSOR, write_tiny_qwen3_vl
from tiny_qwen_vl import CHAT_TEMPLATE, VIDEO_TOKEN_ID
from tiny_video import MIME_TYPES, block_video
from tokenizers import Tokenizer as RawTokenizer
from vl_checks import GREEDY, NUM_STEPS

from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.mrope import chunk_rope
from tpserve.server.qwen3_videos import Qwen3VideoPreprocessor
from tpserve.server.qwen_vision_input import QwenVisionInput
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.validation import Limits
from tpserve.server.videos import decode_frames, demux
from tpserve.v1 import serving_pb2

LIMITS = Limits(context_size=1024, vocab_size=400)
MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens"}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_video")))


def video_input(model_dir: str, image_token: str) -> QwenVisionInput:
    """The model's vision input as the daemon makes it: its frames' times through the tokenizer."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    return QwenVisionInput.from_model_dir(
        model_dir,
        load_model_config(model_dir),
        image_token,
        torch.float32,
        encode_text=lambda text: tokenizer.encode(text, add_bos=False),
    )


@pytest.fixture(scope="module")
def vision(model_dir):
    return video_input(model_dir, "<|image_pad|>")


def ours(vision, model_dir, data: bytes, fmt: str = "mp4"):
    """Our prompt for MESSAGES with the video, its PromptImages (one per temporal patch), and the
    plan and patches they came from (the model's own timed video preprocessor: Qwen3-VL's or GLM's)."""
    part = serving_pb2.Media(mime_type=MIME_TYPES[fmt], data=data)
    ids = Tokenizer.from_model_dir(model_dir).encode_chat(MESSAGES)
    prompt, placed = vision.expand(ids, 1, [part], ["video"], LIMITS)
    images = vision.read([part], placed, ["video"], LIMITS)
    pre = vision.timed_video
    video = demux(data, "video", LIMITS)
    plan = pre.plan(video.header, "video")
    frames = decode_frames(
        video, "video", plan.indices, lambda image: pre.frames.pixels_at(image, *plan.size)
    )
    patches, grid = pre.patches(frames)
    return prompt, images, plan, patches, grid


def transformers_prompt(model_dir: str, plan, grid, num_frames: int, fps: float) -> list[int]:
    """MESSAGES through the template, the video's wrapper replaced as Qwen3VLProcessor replaces it
    (its own replace_video_token and timestamps), tokenized whole."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    processor = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=MERGE, temporal_patch_size=TEMPORAL),
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
    )
    processor._calculate_timestamps = lambda *args: Qwen3VLProcessor._calculate_timestamps(None, *args)
    metadata = VideoMetadata(total_num_frames=num_frames, fps=fps, frames_indices=list(plan.indices))
    inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
    placeholder = Qwen3VLProcessor.replace_video_token(processor, inputs, 0)
    text = Template(CHAT_TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", placeholder)
    tokenizer = RawTokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


def run_video(model_dir, prompt, images, tp_rank=0, tp_size=1, collectives=None):
    """Prefill one prompt with a video's temporal patches (PromptImages; features unread on a follower),
    then NUM_STEPS greedy rounds."""
    engine = tiny_engine(model_dir, 1024, tp_rank, tp_size, collectives)
    open_lane(engine, 0, 200)
    rows = [row for image in images for row in range(image.offset, image.offset + image.num_tokens)]
    media = torch.cat([image.features for image in images]) if tp_rank == 0 else None
    rope = chunk_rope(images, 0, len(prompt))
    logits = engine.forward([(0, 0, tuple(prompt))], media_rows=[rows], media=media, rope=[rope])
    return decode_steps(engine, logits, [len(prompt)], [GREEDY], tp_rank, tp_size, NUM_STEPS)


@pytest.mark.parametrize("fmt, num_frames, fps, size", [("mp4", 10, 4, (40, 34)), ("webm", 7, 2, (50, 30))])
def test_frames_size_and_times_match_transformers(model_dir, fmt, num_frames, fps, size):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    data = block_video(3, num_frames, size, fps=fps, fmt=fmt)
    pre = Qwen3VideoPreprocessor.from_model_dir(model_dir)
    plan = pre.plan(demux(data, "video", LIMITS).header, "video")
    sampler = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    metadata = VideoMetadata(total_num_frames=num_frames, fps=float(fps), width=size[0], height=size[1])
    assert list(plan.indices) == Qwen3VLVideoProcessor.sample_frames(sampler, metadata).tolist()
    bounds = VIDEO_PROCESSOR["size"]
    expected = smart_resize(
        len(plan.indices), size[1], size[0], TEMPORAL, 16, bounds["shortest_edge"], bounds["longest_edge"]
    )
    assert plan.size == expected
    assert list(plan.seconds) == Qwen3VLProcessor._calculate_timestamps(
        None, list(plan.indices), float(fps), 2
    )


def test_the_prompt_puts_each_temporal_patch_after_its_time_as_transformers(vision, model_dir):
    data = block_video(5, 10, (40, 34), fps=4)
    prompt, images, plan, _, grid = ours(vision, model_dir, data)
    assert len(images) == grid[0] == 3  # 5 frames sampled, the last repeated: 3 temporal patches
    assert prompt == transformers_prompt(model_dir, plan, grid, 10, 4.0)
    for image in images:  # each patch's pads, at its own offset
        assert prompt[image.offset : image.offset + image.num_tokens] == [VIDEO_TOKEN_ID] * image.num_tokens
    assert len({image.key for image in images}) == 3


def test_logits_and_greedy_tokens_match_transformers(vision, model_dir):
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(1)
    data = block_video(6, 10, (40, 34), fps=4)
    prompt, images, plan, patches, grid = ours(vision, model_dir, data)
    ours_logits, ours_tokens = run_video(model_dir, prompt, images)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    theirs_logits, theirs_tokens = cached_greedy(
        reference,
        NUM_STEPS,
        input_ids=ids,
        pixel_values_videos=torch.from_numpy(patches),
        video_grid_thw=torch.tensor([grid]),
        mm_token_type_ids=(ids == VIDEO_TOKEN_ID).int() * 2,
    )
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens


def _tp2(ctx, model_dir, prompt, images):
    torch.set_num_threads(1)
    return run_video(model_dir, prompt, images, ctx.rank, 2, world_collectives(ctx, "gloo"))


def test_tp2_equals_tp1_bit_for_bit_with_a_video(vision, model_dir):
    torch.set_num_threads(1)
    prompt, images, *_ = ours(vision, model_dir, block_video(7, 10, (40, 34), fps=4))
    solo_logits, solo_tokens = run_video(model_dir, prompt, images)
    with RankPool(2) as pool:
        pair_logits, pair_tokens = pool.run(_tp2, model_dir, prompt, images, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)

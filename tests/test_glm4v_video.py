"""GLM-4.1V video below the server, on the tiny random GLM-4.1V (tests/tiny_glm4v.py) and short videos
PyAV makes here: the frames sampled, the clip's size and each temporal patch's time against
transformers' own Glm4vVideoProcessor.sample_frames and smart_resize; the prompt (each patch apart as an
image, then its time in whole seconds) against Glm4vProcessor.replace_video_token's text through the
tokenizer, and its positions against get_rope_index; logits and greedy tokens against transformers'
forward on the same pixel_values_videos; tp=2 against tp=1 bit for bit. (transformers' video processor
itself needs torchvision, which has no build for this torch here: the pixels are ours on both sides.)"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import cached_greedy
from jinja2 import Template
from multiproc import RankPool
from test_qwen3_vl_video import LIMITS, MESSAGES, _tp2, ours, run_video, video_input
from tiny_glm4v import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN_ID,
    MERGE,
    TEMPORAL,
    VIDEO_PROCESSOR,
    glm4v_processor,
    write_tiny_glm4v,
)
from tiny_video import block_video
from tokenizers import Tokenizer as RawTokenizer
from vl_checks import NUM_STEPS

from tpserve.ranks.mrope import prompt_positions
from tpserve.server.glm4v_videos import Glm4vVideoPreprocessor
from tpserve.server.videos import demux


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_glm4v(tmp_path_factory.mktemp("glm4v_video")))


@pytest.fixture(scope="module")
def vision(model_dir):
    return video_input(model_dir, "<|image|>")


def sampled(num_frames: int, fps: float) -> list[int]:
    """transformers' Glm4vVideoProcessor.sample_frames (the last frame repeated where the count is odd)."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    sampler = types.SimpleNamespace(fps=VIDEO_PROCESSOR["fps"], max_duration=VIDEO_PROCESSOR["max_duration"])
    metadata = VideoMetadata(total_num_frames=num_frames, fps=fps, duration=num_frames / fps)
    return Glm4vVideoProcessor.sample_frames(sampler, metadata).tolist()


def transformers_prompt(model_dir: str, grid, indices: list[int], fps: float) -> list[int]:
    """MESSAGES through the template, the video token replaced as Glm4vProcessor replaces it (its own
    replace_video_token and replace_frame_token_id), tokenized whole."""
    from transformers import Glm4vProcessor
    from transformers.video_utils import VideoMetadata

    processor = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=MERGE), image_token="<|image|>"
    )
    processor.replace_frame_token_id = lambda *args, **kw: Glm4vProcessor.replace_frame_token_id(
        processor, *args, **kw
    )
    metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=indices)
    inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
    placeholder = Glm4vProcessor.replace_video_token(processor, inputs, 0)
    text = Template(CHAT_TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    text = text.replace("<|video|>", placeholder)
    tokenizer = RawTokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("fmt, num_frames, fps, size", [("mp4", 10, 4, (40, 34)), ("webm", 7, 2, (50, 30))])
def test_frames_size_and_times_match_transformers(model_dir, fmt, num_frames, fps, size):
    from transformers.models.glm4v.video_processing_glm4v import smart_resize

    data = block_video(3, num_frames, size, fps=fps, fmt=fmt)
    plan = Glm4vVideoPreprocessor.from_model_dir(model_dir).plan(demux(data, "video", LIMITS).header, "video")
    expected = sampled(num_frames, float(fps))
    assert list(dict.fromkeys(expected)) == list(plan.indices)  # each frame decoded once
    bounds = VIDEO_PROCESSOR["size"]
    assert plan.size == smart_resize(
        len(expected), size[1], size[0], TEMPORAL, 16, bounds["shortest_edge"], bounds["longest_edge"]
    )
    assert list(plan.seconds) == [index / fps for index in expected[::2]]


def test_the_prompt_and_positions_match_glm4v_processor_and_get_rope_index(vision, model_dir):
    from transformers import Glm4vForConditionalGeneration

    data = block_video(5, 10, (40, 34), fps=4)
    prompt, images, plan, _, grid = ours(vision, model_dir, data)
    assert len(images) == grid[0] == 3  # 5 frames sampled, the last repeated: 3 temporal patches
    assert prompt == transformers_prompt(model_dir, grid, sampled(10, 4.0), 4.0)
    for image in images:  # each patch's image tokens, at its own offset
        assert prompt[image.offset : image.offset + image.num_tokens] == [IMAGE_TOKEN_ID] * image.num_tokens
    assert len({image.key for image in images}) == 3
    types_ = glm4v_processor(model_dir).create_mm_token_type_ids([prompt])
    reference = Glm4vForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    positions, _ = reference.model.get_rope_index(
        torch.tensor([prompt]), torch.tensor(types_), video_grid_thw=torch.tensor([grid])
    )
    axes = prompt_positions(len(prompt), [(image.offset, image.grid) for image in images])
    assert axes == positions[:, 0].tolist()


def test_logits_and_greedy_tokens_match_transformers(vision, model_dir):
    from transformers import Glm4vForConditionalGeneration

    torch.set_num_threads(1)
    data = block_video(6, 10, (40, 34), fps=4)
    prompt, images, plan, patches, grid = ours(vision, model_dir, data)
    ours_logits, ours_tokens = run_video(model_dir, prompt, images)
    reference = Glm4vForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    types_ = glm4v_processor(model_dir).create_mm_token_type_ids([prompt])
    theirs_logits, theirs_tokens = cached_greedy(
        reference,
        NUM_STEPS,
        input_ids=torch.tensor([prompt]),
        pixel_values_videos=torch.from_numpy(np.ascontiguousarray(patches)),
        video_grid_thw=torch.tensor([grid]),
        mm_token_type_ids=torch.tensor(types_),
    )
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens


def test_tp2_equals_tp1_bit_for_bit_with_a_video(vision, model_dir):
    torch.set_num_threads(1)
    prompt, images, *_ = ours(vision, model_dir, block_video(7, 10, (40, 34), fps=4))
    solo_logits, solo_tokens = run_video(model_dir, prompt, images)
    with RankPool(2) as pool:
        pair_logits, pair_tokens = pool.run(_tp2, model_dir, prompt, images, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)

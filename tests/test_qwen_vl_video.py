"""Qwen2.5-VL video below the server, on the tiny random model and short videos PyAV makes here: the
frames sampled by the fps policy, their pixels and grid against transformers' own decode
(video_utils.load_video, PyAV) and Qwen2VLImageProcessorPil frame by frame (transformers' video
processor imports torchvision, which has no build for this torch here); logits and greedy tokens
against transformers' forward on pixel_values_videos, video_grid_thw and second_per_grid_ts; tp=2
against tp=1 bit for bit; the time positions in the rotary."""

from __future__ import annotations

import io
import types

import numpy as np
import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from hf_reference import cached_greedy
from multiproc import RankPool, world_collectives
from PIL import Image
from test_tp_exact import decode_steps
from tiny_qwen_vl import MERGE, TEMPORAL, VIDEO_TOKEN_ID, VISION_END_ID, VISION_START_ID, write_tiny_qwen_vl
from tiny_video import block_video

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.mrope import chunk_rope, prompt_positions, span_rope
from tpserve.server import videos
from tpserve.server.qwen_videos import QwenVideoPreprocessor
from tpserve.server.qwen_vision_input import QwenVisionInput
from tpserve.server.requests import PromptImage
from tpserve.server.validation import Limits
from tpserve.server.videos import decode_frames, demux
from tpserve.v1 import serving_pb2

NUM_STEPS = 6
GREEDY = SamplingParams()
LIMITS = Limits(context_size=1024, vocab_size=400)
WIDE = Limits(
    context_size=1024, vocab_size=400, max_video_seconds=100, max_video_frames=100, max_video_pixels=1 << 20
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return str(write_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl_video")))


@pytest.fixture(scope="module")
def vision(qwen_dir):
    from tpserve.ranks.model_config import load_model_config

    return QwenVisionInput.from_model_dir(
        qwen_dir, load_model_config(qwen_dir), "<|image_pad|>", torch.float32
    )


def ours(model_dir: str, data: bytes):
    pre = QwenVideoPreprocessor.from_model_dir(model_dir)
    video = demux(data, "video", WIDE)
    plan = pre.plan(video.header, "video")
    patches, grid = pre.patches(decode_frames(video, "video", plan.indices, pre.frames.pixels))
    return plan, patches, grid


def theirs(model_dir: str, data: bytes, indices, tmp_path):
    """transformers' decode of the same file (PyAV), its frames at `indices` through
    Qwen2VLImageProcessorPil one by one, laid out as temporal patches; and its metadata."""
    from transformers import Qwen2VLImageProcessorPil
    from transformers.video_utils import load_video

    path = tmp_path / "video.bin"
    path.write_bytes(data)
    # Our indices: its PyAV reader takes a WebM's frame count from the header, which says 0 there.
    frames, metadata = load_video(str(path), backend="pyav", sample_indices_fn=lambda **_: np.array(indices))
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    per_frame = []
    for index in range(len(indices)):
        out = processor(images=Image.fromarray(frames[index]), return_tensors="pt")
        n = out["pixel_values"].shape[0]
        per_frame.append(out["pixel_values"].view(n, 3, TEMPORAL, -1)[:, :, 0])  # one frame's pixels
        grid = out["image_grid_thw"][0].tolist()
    per_frame += [per_frame[-1]] * (-len(per_frame) % TEMPORAL)
    patches = [
        torch.stack(per_frame[t : t + TEMPORAL], dim=2).reshape(n, -1)
        for t in range(0, len(per_frame), TEMPORAL)
    ]
    return torch.cat(patches), (len(per_frame) // TEMPORAL, grid[1], grid[2]), metadata


def transformers_inputs(model_dir: str, data: bytes, prompt, tmp_path) -> dict:
    """What transformers' forward reads for `prompt` (token ids, the video's pads widened) and the
    video: its frames' pixels, video_grid_thw, second_per_grid_ts and the token types."""
    plan, _, _ = ours(model_dir, data)
    pixels, grid, metadata = theirs(model_dir, data, plan.indices, tmp_path)
    ids = torch.tensor([list(prompt)])
    return {
        "input_ids": ids,
        "pixel_values_videos": pixels,
        "video_grid_thw": torch.tensor([grid]),
        "second_per_grid_ts": torch.tensor([TEMPORAL / metadata.sampled_fps]),
        "mm_token_type_ids": (ids == VIDEO_TOKEN_ID).int() * 2,
    }


def transformers_greedy(model_dir: str, data: bytes, prompt, tmp_path):
    """transformers' own last-position logits and greedy tokens over NUM_STEPS, on its KV cache."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return cached_greedy(reference, NUM_STEPS, **transformers_inputs(model_dir, data, prompt, tmp_path))


@pytest.mark.parametrize("fmt, size", [("mp4", (40, 34)), ("webm", (36, 24))])
def test_frames_pixels_and_grid_match_transformers(qwen_dir, tmp_path, fmt, size):
    data = block_video(3, 10, size, fps=4, fmt=fmt)
    plan, patches, grid = ours(qwen_dir, data)
    # transformers' fps policy: 10 frames at 4 fps sampled at 2 fps is 5, rounded down to whole
    # temporal patches, 4, picked by arange(0, 10, 2.5): frames 0, 2, 5, 7; sampled fps 1.6.
    assert plan.indices == (0, 2, 5, 7)
    expected, their_grid, metadata = theirs(qwen_dir, data, plan.indices, tmp_path)
    assert metadata.fps == 4.0 and metadata.total_num_frames == (10 if fmt == "mp4" else 0)
    metadata.total_num_frames = 10
    assert plan.seconds_per_grid == TEMPORAL / metadata.sampled_fps == 1.25
    assert grid == plan.grid == their_grid
    torch.testing.assert_close(torch.from_numpy(patches), expected, rtol=0, atol=1e-5)


def test_an_odd_number_of_frames_repeats_the_last_and_a_long_video_keeps_max_frames(qwen_dir):
    pre = QwenVideoPreprocessor.from_model_dir(qwen_dir)
    header = demux(block_video(4, 5, (24, 24), fps=1), "video", WIDE).header
    plan = pre.plan(header, "video")  # 5 frames at 1 fps: at least min_frames (4)
    assert plan.indices == (0, 1, 2, 3) and plan.grid == (2, 4, 4)
    short = demux(block_video(4, 1, (24, 24), fps=1), "video", WIDE).header
    with pytest.raises(Exception, match="the fewest read is 2"):
        pre.plan(short, "video")


def test_a_videos_time_positions_step_by_the_interval_and_the_delta_follows_the_largest():
    # One text token, a video of three temporal patches of one merged position each, 2.5 time
    # positions apart (truncated: 0, 2, 5), two text tokens continuing from its grid (1 + 1).
    axes = prompt_positions(6, [(1, (1, 1), 3, 2.5)])
    assert axes == [[0, 1, 3, 6, 2, 3], [0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 2, 3]]
    assert span_rope(axes, 0, 6)[-1] == 6 + 1 - 6  # past the prompt: from its largest position, 6
    assert span_rope(axes, 4, 6) == (2, 3, 2, 3, 2, 3, 1)
    # A resumed reply's tokens past the prompt: where its decode steps put them, KV position + 1.
    video = PromptImage(1, 3, -5, None, (1, 1), 3, 2.5)
    assert chunk_rope([video], 4, 4, prompt_length=6) == (2, 3, 7, 8, 2, 3, 7, 8, 2, 3, 7, 8, 1)


def video_prompt(merged_frames, before=(40, 41), after=(50, 51, 52, 53, 54, 55)):
    frames, rows, cols = merged_frames
    ids = (*before, VISION_START_ID, *[VIDEO_TOKEN_ID] * (frames * rows * cols), VISION_END_ID, *after)
    return ids, len(before) + 1


def read_video(vision, data):
    """The video's PromptImage, as the submitter reads it: expand's demux, then read's decode."""
    part = serving_pb2.Media(mime_type="video/mp4", data=data)
    ids = [40, 41, VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID]
    _, placed = vision.expand(ids, 1, [part], ["video"], LIMITS)
    (image,) = vision.read([part], placed, ["video"], LIMITS)
    return image


def run_video(model_dir, prompt, image, tp_rank=0, tp_size=1, collectives=None):
    """Prefill one prompt with its video (a PromptImage; features unread on a follower), then
    NUM_STEPS greedy rounds."""
    engine = tiny_engine(model_dir, 1024, tp_rank, tp_size, collectives)
    open_lane(engine, 0, 200)
    axes = prompt_positions(len(prompt), [(image.offset, image.grid, image.frames, image.interval)])
    rows = list(range(image.offset, image.offset + image.num_tokens))
    logits = engine.forward(
        [(0, 0, prompt)],
        media_rows=[rows],
        media=image.features if tp_rank == 0 else None,
        rope=[span_rope(axes, 0, len(prompt))],
    )
    return decode_steps(engine, logits, [len(prompt)], [GREEDY], tp_rank, tp_size, NUM_STEPS)


def test_logits_and_greedy_tokens_match_transformers(qwen_dir, vision, tmp_path):
    torch.set_num_threads(1)
    data = block_video(5, 10, (40, 34))
    image = read_video(vision, data)
    assert (image.frames, image.grid, image.interval) == (2, (3, 3), 5.0)  # 4 * 1.25 time positions a patch
    prompt, offset = video_prompt((image.frames, *image.grid))
    assert offset == image.offset
    ours_logits, ours_tokens = run_video(qwen_dir, prompt, image)
    theirs_logits, theirs_tokens = transformers_greedy(qwen_dir, data, prompt, tmp_path)
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens
    # The time positions changed the logits: the same frames read as one instant give others.
    still = type(image)(
        image.offset, image.num_tokens, image.key, image.features, image.grid, image.frames, 0.0
    )
    still_logits, _ = run_video(qwen_dir, prompt, still)
    assert (still_logits[0, 0] - ours_logits[0, 0]).abs().max() > 1e-3


def test_video_tokens_take_their_grid_in_the_prompt(vision):
    data = block_video(6, 10, (40, 34))
    ids = [40, VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID, 50]
    part = serving_pb2.Media(mime_type="video/mp4", data=data)
    out, offsets = vision.expand(ids, 1, [part], ["messages[0].parts[0]"], LIMITS)
    assert [place.offset for place in offsets] == [2] and out == [
        40,
        VISION_START_ID,
        *[VIDEO_TOKEN_ID] * 18,
        VISION_END_ID,
        50,
    ]
    assert MERGE == 2  # 2 temporal patches of a 6x6 patch grid, merged 2x2: 2 * 3 * 3


class CountedFile(io.BytesIO):
    """The file PyAV reads a video's bytes through, counting what it opens and reads."""

    num_opened = 0
    num_read = 0

    def __init__(self, data: bytes):
        super().__init__(data)
        CountedFile.num_opened += 1

    def read(self, size: int = -1) -> bytes:
        chunk = super().read(size)
        CountedFile.num_read += len(chunk)
        return chunk


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_a_video_is_read_from_its_bytes_once_from_prompt_to_features(vision, monkeypatch, fmt):
    """expand demuxes the file to count its frames; read decodes those packets instead of opening
    and demuxing the file again: PyAV reads the bytes once in all, and the features are the same
    as a second, separate decode of the file gives."""
    data = block_video(9, 10, (40, 34), fmt=fmt)
    expected = read_video(vision, data)
    monkeypatch.setattr(videos, "io", types.SimpleNamespace(BytesIO=CountedFile))
    CountedFile.num_opened = CountedFile.num_read = 0
    part = serving_pb2.Media(mime_type=f"video/{fmt}", data=data)
    _, placed = vision.expand(
        [40, VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID], 1, [part], ["video"], LIMITS
    )
    (image,) = vision.read([part], placed, ["video"], LIMITS)
    assert (CountedFile.num_opened, CountedFile.num_read) == (1, len(data))
    assert (image.frames, image.grid, image.interval) == (expected.frames, expected.grid, expected.interval)
    torch.testing.assert_close(image.features, expected.features, rtol=0, atol=0)


def _tp2(ctx, model_dir, prompt, image):
    torch.set_num_threads(1)
    return run_video(model_dir, prompt, image, ctx.rank, 2, world_collectives(ctx, "gloo"))


def test_tp2_equals_tp1_bit_for_bit_with_a_video(qwen_dir, vision):
    torch.set_num_threads(1)
    image = read_video(vision, block_video(7, 10, (40, 34)))
    prompt, _ = video_prompt((image.frames, *image.grid))
    solo_logits, solo_tokens = run_video(qwen_dir, prompt, image)
    with RankPool(2) as pool:
        pair_logits, pair_tokens = pool.run(_tp2, qwen_dir, prompt, image, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)


def test_replies_continue_past_the_videos_last_time_position(qwen_dir, vision, tmp_path):
    """A prompt ending soon after a video: its last time position (start + 5) is past the text's
    (start + 4), and the reply's positions continue from the prompt's largest, as transformers'
    rope deltas do."""
    torch.set_num_threads(1)
    data = block_video(8, 10, (40, 34))
    image = read_video(vision, data)
    prompt, _ = video_prompt((image.frames, *image.grid), after=(50,))
    ours_logits, ours_tokens = run_video(qwen_dir, prompt, image)
    theirs_logits, theirs_tokens = transformers_greedy(qwen_dir, data, prompt, tmp_path)
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens

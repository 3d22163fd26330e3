"""The Qwen2.5-VL path below the server: smart-resize preprocessing, the windowed vision tower and the
text model's multimodal rotary positions, against transformers' own Qwen2_5_VLForConditionalGeneration
and Qwen2VLImageProcessorPil on a tiny random model; tp=2 against tp=1 bit for bit; a batch with and
without images against each prompt's solo run; the positions over the wire."""

from __future__ import annotations

import io

import pytest
import torch
from multiproc import RankPool
from PIL import Image
from tiny_llava import block_image
from tiny_qwen_vl import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, write_tiny_qwen_vl
from vl_checks import (
    check_batch_equals_solo,
    check_logits_and_greedy,
    check_tp2_equals_tp1,
    image_of,
)

from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.mrope import prompt_positions, span_rope
from tpserve.ranks.qwen_vision import load_qwen_vision_tower
from tpserve.ranks.wire import WireError, decode, encode
from tpserve.ranks.wire_messages import Prefill
from tpserve.ranks.wire_spans import Span
from tpserve.server.images import decode_image
from tpserve.server.qwen_images import QwenPreprocessor

SIZES = ((61, 83), (40, 34), (130, 20))  # (width, height): 14x10, 6x6 and 22x4 patch grids


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return str(write_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl")))


def patches_of(model_dir: str, data: bytes):
    return QwenPreprocessor.from_model_dir(model_dir).patches(decode_image(data, "image", 1 << 20))


def image_prompt(merged, before=(40, 41), after=(50, 51, 52)):
    """Token ids around one image (vision start, its pads, vision end) and where the pads start."""
    rows, cols = merged
    ids = (*before, VISION_START_ID, *[IMAGE_TOKEN_ID] * (rows * cols), VISION_END_ID, *after)
    return ids, len(before) + 1


def test_preprocessing_matches_transformers_qwen2vl_processor(qwen_dir):
    from transformers import Qwen2VLImageProcessorPil

    theirs_processor = Qwen2VLImageProcessorPil.from_pretrained(qwen_dir)
    for size, fmt in zip(SIZES, ("PNG", "WEBP", "JPEG")):
        data = block_image(3, size, fmt)
        patches, grid = patches_of(qwen_dir, data)
        theirs = theirs_processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
        assert list(grid) == theirs["image_grid_thw"][0].tolist()
        torch.testing.assert_close(torch.from_numpy(patches), theirs["pixel_values"], rtol=0, atol=1e-5)


def test_vision_features_match_transformers(qwen_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    processor = Qwen2VLImageProcessorPil.from_pretrained(qwen_dir)
    for size in SIZES:  # windows whole and cut by the edges; a tall and a wide grid
        data = block_image(5, size)
        ours, _ = image_of(qwen_dir, data)
        inputs = processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
        with torch.no_grad():
            theirs = reference.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        torch.testing.assert_close(ours, theirs.pooler_output[0], rtol=0, atol=1e-4)


def test_logits_and_greedy_tokens_match_transformers(qwen_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    torch.set_num_threads(1)
    data = block_image(1, SIZES[0])
    features, merged = image_of(qwen_dir, data)
    prompt, offset = image_prompt(merged)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    inputs = Qwen2VLImageProcessorPil.from_pretrained(qwen_dir)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt"
    )
    image = (offset, features, merged)
    check_logits_and_greedy(qwen_dir, reference, inputs, prompt, image, IMAGE_TOKEN_ID)


def test_a_batch_with_and_without_images_equals_each_solo_run(qwen_dir):
    torch.set_num_threads(1)
    first = image_of(qwen_dir, block_image(1, SIZES[0]))
    check_batch_equals_solo(qwen_dir, image_prompt, first, image_of(qwen_dir, block_image(2, SIZES[2])))


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


def test_tp2_equals_tp1_bit_for_bit_with_images(pool, qwen_dir):
    torch.set_num_threads(1)
    check_tp2_equals_tp1(qwen_dir, image_prompt, image_of(qwen_dir, block_image(4, SIZES[0])), pool)


def test_rope_positions_travel_on_the_wire_and_a_wrong_count_is_refused():
    axes = prompt_positions(9, [(2, (2, 2))])
    assert axes == [[0, 1, 2, 2, 2, 2, 4, 5, 6], [0, 1, 2, 2, 3, 3, 4, 5, 6], [0, 1, 2, 3, 2, 3, 4, 5, 6]]
    rope = span_rope(axes, 0, 9)
    assert rope[-1] == 6 + 1 - 9  # the delta after the prompt: its largest position + 1 - its length
    span = Span(3, 0, tuple(range(10, 19)), media=((2, 4),), blocks=(0, 1), rope=rope)
    assert decode(encode(Prefill((span,)))) == Prefill((span,))
    with pytest.raises(WireError, match="rope positions"):
        encode(Prefill((Span(3, 0, (1, 2), rope=(0, 1, 2, 0, 1, 2)),)))


def test_video_grids_with_temporal_patches_match_transformers(qwen_dir):
    """The tower over a grid of several temporal patches (a video's frames, two per patch): the
    windows and the full-attention block span every frame, as transformers' get_video_features."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = load_model_config(qwen_dir)
    tower = load_qwen_vision_tower(qwen_dir, config.vision, torch.float32)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    grid = (3, 6, 10)
    patches = torch.randn(3 * 6 * 10, config.vision.patch_values, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = reference.model.get_video_features(patches, torch.tensor([grid])).pooler_output[0]
    torch.testing.assert_close(tower.features(patches, grid), theirs, rtol=0, atol=1e-4)

"""The Qwen3-VL image path below the server, on a tiny random Qwen3-VL that transformers writes
(tests/tiny_qwen3_vl.py): the tower's features and deepstack features reach the text model (added after
its first layers at the image's rows) and its interleaved multimodal rotary turns them, giving
transformers' own logits and greedy tokens, in one pass and in chunks that cut the image; tp=2 against
tp=1 bit for bit; a batch with and without images against each prompt's solo run (video:
tests/test_qwen3_vl_video.py)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from test_qwen_vl import image_prompt
from tiny_llava import block_image
from tiny_qwen3_vl import write_tiny_qwen3_vl
from tiny_qwen_vl import IMAGE_TOKEN_ID
from vl_checks import (
    check_batch_equals_solo,
    check_logits_and_greedy,
    check_tp2_equals_tp1,
    image_of,
    run_prompts,
)

from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.mrope import section_axes

SIZES = ((70, 50), (40, 90))  # (width, height): 10x6 and 6x12 patch grids of 8 pixels, past the 4x4 table


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl")))


def test_logits_and_greedy_tokens_match_transformers(model_dir):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

    torch.set_num_threads(1)
    data = block_image(1, SIZES[0])
    features, merged = image_of(model_dir, data)
    assert features.shape[1] == 2 * load_model_config(model_dir).hidden_size  # one deepstack merger
    prompt, offset = image_prompt(merged)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt"
    )
    image = (offset, features, merged)
    ours_logits = check_logits_and_greedy(model_dir, reference, inputs, prompt, image, IMAGE_TOKEN_ID)
    # The deepstack rows changed the logits: without them (zeros) the reply reads otherwise.
    hidden = features.shape[1] // 2
    flat = torch.cat([features[:, :hidden], torch.zeros_like(features[:, hidden:])], dim=1)
    without, _ = run_prompts(model_dir, [prompt], [(offset, flat, merged)])
    assert (without[0, 0] - ours_logits[0, 0]).abs().max() > 1e-3


def test_the_rotary_interleaves_its_axes_as_transformers():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    section = (24, 20, 20)  # Qwen3-VL-4B's
    freqs = torch.stack([torch.full((1, 1, 64), float(axis)) for axis in range(3)])  # [3, 1, 1, half]
    theirs = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(
        type("Holder", (), {"mrope_section": section})(), freqs
    )[0, 0, :64]
    assert section_axes(section, interleaved=True).tolist() == theirs.long().tolist()
    assert section_axes((2, 3, 3), interleaved=False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_a_batch_with_and_without_images_equals_each_solo_run(model_dir):
    torch.set_num_threads(1)
    first = image_of(model_dir, block_image(1, SIZES[0]))
    check_batch_equals_solo(model_dir, image_prompt, first, image_of(model_dir, block_image(2, SIZES[1])))


def test_tp2_equals_tp1_bit_for_bit_with_images(model_dir):
    torch.set_num_threads(1)
    check_tp2_equals_tp1(model_dir, image_prompt, image_of(model_dir, block_image(4, SIZES[0])))

"""GLM-4.5V (Glm4vMoeForConditionalGeneration) below the server, on a tiny random one that transformers
writes (tests/tiny_glm4v.py, moe=True): GLM-4.1V's tower (tpserve/ranks/glm4v_vision.py) before GLM-4.5's
mixture-of-experts decoder, whose rotate-half partial rotary is multimodal in (t, h, w) runs: its tower's
features, logits and greedy tokens against transformers' own, in one pass and in chunks that cut the
image; tp=2 against tp=1 bit for bit; a batch with and without images against each prompt's solo run."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from test_glm4v import SIZES, image_prompt
from tiny_glm4v import IMAGE_TOKEN_ID, write_tiny_glm4v
from tiny_llava import block_image
from vl_checks import (
    check_batch_equals_solo,
    check_logits_and_greedy,
    check_tp2_equals_tp1,
    image_of,
)

from tpserve.ranks.model_config import load_model_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_glm4v(tmp_path_factory.mktemp("glm4v_moe"), moe=True))


def test_the_config_reads_glm45s_decoder_and_glm41vs_tower(model_dir):
    config = load_model_config(model_dir)
    assert config.family == "glm4_moe" and config.moe.sparse_layers == (1, 2)
    assert config.rotary_dim == 8 and not config.rotary_interleaved  # rotate-half over half a head
    assert config.vision.mrope_section == (2, 1, 1) and config.vision.image_token_id == IMAGE_TOKEN_ID


def test_features_logits_and_greedy_tokens_match_transformers(model_dir):
    from transformers import Glm4vImageProcessorPil, Glm4vMoeForConditionalGeneration

    torch.set_num_threads(1)
    data = block_image(1, SIZES[0])
    features, merged = image_of(model_dir, data)
    reference = Glm4vMoeForConditionalGeneration.from_pretrained(
        model_dir,
        dtype=torch.float32,
        experts_implementation="eager",  # its grouped product wants widths of 16s
    ).eval()
    inputs = Glm4vImageProcessorPil.from_pretrained(model_dir)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt"
    )
    with torch.no_grad():
        theirs = reference.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    torch.testing.assert_close(features, theirs.pooler_output[0], rtol=0, atol=1e-4)
    prompt, offset = image_prompt(merged)
    image = (offset, features, merged)
    check_logits_and_greedy(model_dir, reference, inputs, prompt, image, IMAGE_TOKEN_ID)


def test_a_batch_with_and_without_images_equals_each_solo_run(model_dir):
    torch.set_num_threads(1)
    first = image_of(model_dir, block_image(1, SIZES[0]))
    check_batch_equals_solo(model_dir, image_prompt, first, image_of(model_dir, block_image(2, SIZES[1])))


def test_tp2_equals_tp1_bit_for_bit_with_images(model_dir):
    torch.set_num_threads(1)
    check_tp2_equals_tp1(model_dir, image_prompt, image_of(model_dir, block_image(4, SIZES[0])))

"""The GLM-4.1V image path below the server, on a tiny random GLM-4.1V that transformers writes
(tests/tiny_glm4v.py): GLM's smart resize and patches against Glm4vImageProcessorPil; the tower (its
position table resampled bicubically, the downsample conv, the GLU merger) against transformers' own;
the prompt's expansion against Glm4vProcessor and its multimodal positions against get_rope_index; the
text model (interleaved partial mrope, four norms a layer) giving transformers' logits and greedy
tokens, in one pass and in chunks that cut the image, and in bfloat16 as near float32 as transformers'
bfloat16 (the tower too); tp=2 against tp=1 bit for bit; a batch with and without images against each
prompt's solo run; a transformers 4 config."""

from __future__ import annotations

import copy
import functools
import io
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_lanes import open_lane
from hf_reference import cached_greedy
from PIL import Image
from tiny_glm4v import BEGIN_IMAGE_ID, END_IMAGE_ID, IMAGE_TOKEN_ID, glm4v_processor, write_tiny_glm4v
from tiny_llava import block_image
from vl_checks import (
    NUM_STEPS,
    check_batch_equals_solo,
    check_logits_and_greedy,
    check_tp2_equals_tp1,
    image_of,
    run_prompts,
)

from tpserve.kernels.linear import ROW_TILE
from tpserve.kernels.rotary import partial_rotary_order
from tpserve.ranks.engine import Engine
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.glm4v_vision import load_glm4v_vision_tower
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import load_model_config, parse_model_config
from tpserve.ranks.mrope import prompt_positions, span_rope
from tpserve.server.glm4v_images import Glm4vPreprocessor
from tpserve.server.images import decode_image
from tpserve.server.qwen_vision_input import DEFAULT_LIMITS, QwenVisionInput
from tpserve.server.tokenizer import Tokenizer

# (width, height): grids of 6x8 and 12x4 patches (past the 4x4 table), one merge block (an image
# smaller than one, scaled up first), a wide one cut down to the pixel bound, and a sliver
SIZES = ((70, 50), (40, 90), (10, 12), (300, 200), (9, 200))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_glm4v(tmp_path_factory.mktemp("glm4v")))


def image_prompt(merged, before=(40, 41), after=(50, 51, 52)):
    """Token ids around one image (begin of image, its tokens, end of image) and where they start."""
    rows, cols = merged
    ids = (*before, BEGIN_IMAGE_ID, *[IMAGE_TOKEN_ID] * (rows * cols), END_IMAGE_ID, *after)
    return ids, len(before) + 1


def test_preprocessing_matches_transformers_glm4v_processor(model_dir):
    from transformers import Glm4vImageProcessorPil

    theirs_processor = Glm4vImageProcessorPil.from_pretrained(model_dir)
    ours = Glm4vPreprocessor.from_model_dir(model_dir)
    for size, fmt in zip(SIZES, ("PNG", "WEBP", "JPEG", "PNG", "PNG")):
        data = block_image(3, size, fmt)
        patches, grid = ours.patches(decode_image(data, "image", 1 << 20))
        theirs = theirs_processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
        assert list(grid) == theirs["image_grid_thw"][0].tolist()
        torch.testing.assert_close(torch.from_numpy(patches), theirs["pixel_values"], rtol=0, atol=1e-6)


def test_vision_features_match_transformers(model_dir):
    from transformers import Glm4vForConditionalGeneration, Glm4vImageProcessorPil

    torch.set_num_threads(1)
    reference = Glm4vForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = Glm4vImageProcessorPil.from_pretrained(model_dir)
    for size in SIZES[:3]:
        data = block_image(5, size)
        ours, _ = image_of(model_dir, data)
        inputs = processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
        with torch.no_grad():
            theirs = reference.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        torch.testing.assert_close(ours, theirs.pooler_output[0], rtol=0, atol=1e-4)


def test_prompt_and_positions_match_glm4v_processor_and_get_rope_index(model_dir):
    from transformers import Glm4vForConditionalGeneration

    config = load_model_config(model_dir)
    processor = glm4v_processor(model_dir)
    tokenizer = processor.tokenizer
    images = [block_image(1, SIZES[0]), block_image(2, SIZES[1])]
    text = (
        "hello <|begin_of_image|><|image|><|end_of_image|> world <|begin_of_image|><|image|><|end_of_image|>!"
    )
    theirs = processor(text=[text], images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt")
    encode = functools.partial(Tokenizer.from_model_dir(model_dir).encode, add_bos=False)
    vision = QwenVisionInput.from_model_dir(model_dir, config, "<|image|>", torch.float32, encode_text=encode)
    media = [SimpleNamespace(data=d, mime_type="image/png") for d in images]
    ids = tokenizer(text)["input_ids"]
    expanded, placed = vision.expand(ids, 2, media, ["image 0", "image 1"])
    assert expanded == theirs["input_ids"][0].tolist()
    read = vision.read(media, placed, ["image 0", "image 1"], DEFAULT_LIMITS)
    axes = prompt_positions(len(expanded), [(image.offset, image.grid) for image in read])
    reference = Glm4vForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    positions, delta = reference.model.get_rope_index(
        theirs["input_ids"], theirs["mm_token_type_ids"], image_grid_thw=theirs["image_grid_thw"]
    )
    assert axes == positions[:, 0].tolist()
    assert max(max(axis) for axis in axes) + 1 - len(expanded) == delta.item()


def test_the_interleaved_partial_rotary_order_pairs_as_transformers():
    # GLM's rotate_half_llm turns (0, 1), (2, 3) of the 4 rotating dims of 8; dims 4..7 rest
    assert partial_rotary_order(8, 4, interleaved=True).tolist() == [0, 2, 4, 5, 1, 3, 6, 7]
    assert partial_rotary_order(8, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_logits_and_greedy_tokens_match_transformers(model_dir):
    from transformers import Glm4vForConditionalGeneration, Glm4vImageProcessorPil

    torch.set_num_threads(1)
    data = block_image(1, SIZES[0])
    features, merged = image_of(model_dir, data)
    prompt, offset = image_prompt(merged)
    reference = Glm4vForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = Glm4vImageProcessorPil.from_pretrained(model_dir)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt"
    )
    image = (offset, features, merged)
    check_logits_and_greedy(model_dir, reference, inputs, prompt, image, IMAGE_TOKEN_ID)


def test_text_only_logits_match_transformers(model_dir):
    from transformers import Glm4vForConditionalGeneration

    torch.set_num_threads(1)
    prompt = (40, 41, 42, 43, 44, 45, 46)
    ours_logits, ours_tokens = run_prompts(model_dir, [prompt], [None])
    reference = Glm4vForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    theirs_logits, theirs_tokens = cached_greedy(reference, NUM_STEPS, input_ids=torch.tensor([prompt]))
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens


def test_a_batch_with_and_without_images_equals_each_solo_run(model_dir):
    torch.set_num_threads(1)
    first = image_of(model_dir, block_image(1, SIZES[0]))
    check_batch_equals_solo(model_dir, image_prompt, first, image_of(model_dir, block_image(2, SIZES[1])))


def test_tp2_equals_tp1_bit_for_bit_with_images(model_dir):
    torch.set_num_threads(1)
    check_tp2_equals_tp1(model_dir, image_prompt, image_of(model_dir, block_image(4, SIZES[0])))


def test_a_transformers_4_config_reads_as_transformers_5s_and_a_wrong_one_is_refused(model_dir):
    """GLM-4.1V-9B's own config.json (transformers 4): the sections in a rope_scaling of type "default",
    partial_rotary_factor and attention_bias beside them in text_config."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    old = copy.deepcopy(raw)
    rope = old["text_config"].pop("rope_parameters")
    old["text_config"] |= {
        "rope_scaling": {"type": "default", "mrope_section": rope["mrope_section"]},
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
        "attention_bias": True,
    }
    assert parse_model_config(old) == parse_model_config(raw)
    config = parse_model_config(raw)
    assert (config.rotary_dim, config.rotary_interleaved, config.qkv_bias) == (8, True, True)
    wrong = copy.deepcopy(raw)
    wrong["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(ModelFileError, match="mrope_section"):
        parse_model_config(wrong)
    wrong = copy.deepcopy(raw)
    wrong["vision_config"]["hidden_act"] = "gelu"
    with pytest.raises(ModelFileError, match="hidden_act"):
        parse_model_config(wrong)


def bfloat16_logits(model_dir, prompt, offset, features, merged) -> torch.Tensor:
    """Our last-position logits of one image prompt in one pass at tp=1, in bfloat16: [vocab]."""
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=1, dtype=torch.bfloat16, max_positions=256, row_tile=ROW_TILE
    )
    kv = KVPool(
        model.config.num_layers, 256, model.kv_heads_per_piece(), model.config.head_dim, torch.bfloat16
    )
    engine = Engine(model, kv)
    open_lane(engine, 0, len(prompt))
    rows = list(range(offset, offset + merged[0] * merged[1]))
    rope = span_rope(prompt_positions(len(prompt), [(offset, merged)]), 0, len(prompt))
    return engine.forward([(0, 0, prompt)], media_rows=[rows], media=features, rope=[rope])[0].float()


# Measured on six image prompts: our median error 0.171 against transformers' 0.171 (1.00x)
def test_bfloat16_logits_with_an_image_are_as_near_float32_as_transformers_bfloat16(model_dir):
    from transformers import Glm4vForConditionalGeneration, Glm4vImageProcessorPil

    torch.set_num_threads(1)
    config = load_model_config(model_dir)
    tower = load_glm4v_vision_tower(model_dir, config.vision, torch.bfloat16)
    references = {
        dtype: Glm4vForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    processor = Glm4vImageProcessorPil.from_pretrained(model_dir)
    our_errors, their_errors = [], []
    for seed, (size, before) in enumerate(zip(SIZES[:3] * 2, [(40, 41), (60,) * 9, (70, 71, 72)] * 2)):
        data = block_image(seed, size)
        inputs = processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
        grid = tuple(inputs["image_grid_thw"][0].tolist())
        merged = (grid[1] // 2, grid[2] // 2)
        prompt, offset = image_prompt(merged, before=before)
        ids = torch.tensor([prompt])
        kwargs = {
            "image_grid_thw": inputs["image_grid_thw"],
            "mm_token_type_ids": (ids == IMAGE_TOKEN_ID).int(),
        }
        with torch.no_grad():
            truth, theirs = (
                references[d](input_ids=ids, pixel_values=inputs["pixel_values"], **kwargs)
                .logits[0, -1]
                .float()
                for d in references
            )
        features = tower.features(inputs["pixel_values"], grid)
        ours = bfloat16_logits(model_dir, prompt, offset, features, merged)
        our_errors.append(float((ours - truth).abs().max()))
        their_errors.append(float((theirs - truth).abs().max()))
    assert min(our_errors) > 0
    assert statistics.median(our_errors) <= 1.25 * statistics.median(their_errors), (our_errors, their_errors)

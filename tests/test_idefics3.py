"""The Idefics3 and SmolVLM image path below the server, on tiny random models transformers writes
(tests/tiny_idefics3.py): the logits and greedy tokens against transformers' forward on the same pixels
(its Idefics3 image processor's), in one pass and in chunks that cut the tiles, with tiles and a global
image or one tile alone; tp=2 against tp=1 bit for bit; a batch with and without images against each
prompt's solo run (the processor's side: tests/test_idefics3_inputs.py)."""

from __future__ import annotations

import io

import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from hf_reference import cached_greedy
from image_prompt_checks import check_batch_equals_solo, check_tp2_equals_tp1
from PIL import Image
from test_tp_exact import decode_steps
from tiny_idefics3 import (
    ARCHITECTURES,
    IMAGE_SEQ_LEN,
    IMAGE_TOKEN,
    IMAGE_TOKEN_ID,
    write_tiny_idefics3,
)
from tiny_llava import block_image

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.leader import media_in_chunk
from tpserve.ranks.model_config import load_model_config
from tpserve.server.idefics3_input import Idefics3VisionInput
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.validation import Limits
from tpserve.v1 import serving_pb2

NUM_STEPS = 6
GREEDY = SamplingParams()
LIMITS = Limits(context_size=4096, vocab_size=320)
# (width, height): 3x3 tiles, 3x2, 1x3 (a wide strip) and a small square one (upscaled: 3x3)
SIZES = ((70, 50), (40, 90), (130, 20), (20, 20))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_dir(request, tmp_path_factory) -> str:
    return str(write_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), architecture=request.param))


@pytest.fixture(scope="module")
def one_tile_dir(tmp_path_factory) -> str:
    """The same model whose processor does not split: every image is one tile (no global image)."""
    return str(write_tiny_idefics3(tmp_path_factory.mktemp("idefics3-whole"), splitting=False))


def vision_of(model_dir: str) -> tuple[Idefics3VisionInput, Tokenizer]:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    config = load_model_config(model_dir)
    vision = Idefics3VisionInput.from_model_dir(
        model_dir,
        config,
        IMAGE_TOKEN,
        torch.float32,
        encode_text=lambda t: tokenizer.encode(t, add_bos=False),
    )
    return vision, tokenizer


def media(data: bytes) -> serving_pb2.Media:
    return serving_pb2.Media(mime_type="image/png", data=data)


def chat_prompt(model_dir: str, images: list[bytes], text: str = "what is in this picture"):
    """A chat's prompt ids as the daemon builds them (the template, then each image's tiles) and its
    PromptImages (one per tile)."""
    vision, tokenizer = vision_of(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    ids = tokenizer.encode_chat([{"role": "user", "content": content}], add_generation_prompt=True)
    parts, wheres = [media(data) for data in images], [f"image {n}" for n in range(len(images))]
    ids, placed = vision.expand(ids, len(images), parts, wheres, LIMITS)
    return tuple(ids), vision.read(parts, placed, wheres, LIMITS)


def run_prompts(model_dir, prompts, images, tp_rank=0, tp_size=1, collectives=None, chunk=0):
    """Prefill `prompts` (images: each prompt's PromptImages; a follower's hold no features) in one
    pass, or one prompt in passes of `chunk` tokens; then NUM_STEPS greedy rounds."""
    engine = tiny_engine(model_dir, 2048, tp_rank, tp_size, collectives)

    def placed(prompt_images, start, length):
        runs, rows = media_in_chunk(prompt_images, start, length)
        return [offset + k for offset, length in runs for k in range(length)], rows

    if chunk:
        (prompt,), (prompt_images,) = prompts, images
        open_lane(engine, 0, 300)
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            rows, features = placed(prompt_images, start, len(piece))
            media_rows = torch.cat(features) if features and tp_rank == 0 else None
            logits = engine.forward([(0, start, piece)], media_rows=[rows], media=media_rows)
    else:
        spans, media_rows, features = [], [], []
        for lane, (prompt, prompt_images) in enumerate(zip(prompts, images)):
            open_lane(engine, lane, 300)
            spans.append((lane, 0, prompt))
            rows, lane_features = placed(prompt_images, 0, len(prompt))
            media_rows.append(rows)
            features += lane_features
        rank0 = torch.cat(features) if features and tp_rank == 0 else None
        logits = engine.forward(spans, media_rows=media_rows, media=rank0)
    positions = [len(p) for p in prompts]
    return decode_steps(engine, logits, positions, [GREEDY] * len(prompts), tp_rank, tp_size, NUM_STEPS)


def transformers_run(model_dir: str, ids, images: list[bytes]):
    """transformers' logits and greedy tokens for the prompt ids, its processor's pixels."""
    from transformers import AutoModelForImageTextToText, Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil.from_pretrained(model_dir)
    pixels = processor(images=[[Image.open(io.BytesIO(d)) for d in images]], return_tensors="pt")
    reference = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return cached_greedy(
        reference,
        NUM_STEPS,
        input_ids=torch.tensor([ids]),
        pixel_values=pixels["pixel_values"],
        pixel_attention_mask=pixels["pixel_attention_mask"],
    )


def test_logits_and_greedy_tokens_match_transformers(model_dir):
    torch.set_num_threads(1)
    images = [block_image(1, SIZES[0]), block_image(2, SIZES[1])]
    ids, prompt_images = chat_prompt(model_dir, images)
    assert len(prompt_images) == 10 + 7  # 3x3 tiles and 3x2, each with its global image
    theirs_logits, theirs_tokens = transformers_run(model_dir, ids, images)
    ours_logits, ours_tokens = run_prompts(model_dir, [ids], [prompt_images])
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens
    # In chunks that cut the tiles (a long prompt's prefill, or a cached prefix, does).
    chunked, chunked_tokens = run_prompts(model_dir, [ids], [prompt_images], chunk=7)
    torch.testing.assert_close(chunked[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert chunked_tokens == ours_tokens
    # The tiles changed the logits: without the features (the image tokens' own embeddings) it reads otherwise.
    without, _ = run_prompts(model_dir, [ids], [()])
    assert (without[0, 0] - ours_logits[0, 0]).abs().max() > 1e-2


def test_one_tile_images_match_transformers(one_tile_dir):
    torch.set_num_threads(1)
    images = [block_image(5, SIZES[2])]
    ids, prompt_images = chat_prompt(one_tile_dir, images)
    assert len(prompt_images) == 1 and ids.count(IMAGE_TOKEN_ID) == IMAGE_SEQ_LEN
    theirs_logits, theirs_tokens = transformers_run(one_tile_dir, ids, images)
    ours_logits, ours_tokens = run_prompts(one_tile_dir, [ids], [prompt_images])
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens


def test_a_batch_with_and_without_images_equals_each_solo_run(model_dir):
    check_batch_equals_solo(run_prompts, chat_prompt, model_dir, (SIZES[0], SIZES[2]))


def test_tp2_equals_tp1_bit_for_bit_with_images(model_dir):
    torch.set_num_threads(1)
    ids, prompt_images = chat_prompt(model_dir, [block_image(4, SIZES[1])])
    check_tp2_equals_tp1(run_prompts, model_dir, ids, prompt_images)

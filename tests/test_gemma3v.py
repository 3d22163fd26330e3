"""Gemma 3 with images below the server, on a tiny random Gemma3ForConditionalGeneration transformers
writes (tests/tiny_gemma3v.py): the prompt and pixels against Gemma3Processor's own; the logits and
greedy tokens against transformers' forward on the same ids and pixels (its token_type_ids: each
image's tokens see each other, in sliding layers whose window is shorter than an image and in the
global one), in one pass and in chunks that keep each image whole; tp=2 against tp=1 bit for bit; a
batch with and without images against each prompt's solo run."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from hf_reference import cached_greedy
from image_prompt_checks import check_batch_equals_solo, check_tp2_equals_tp1
from PIL import Image
from test_tp_exact import decode_steps
from tiny_gemma3v import BOI_TOKEN, IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, write_tiny_gemma3v
from tiny_llava import block_image

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.leader import media_in_chunk
from tpserve.ranks.model_config import load_model_config, parse_model_config
from tpserve.server.gemma3_input import Gemma3VisionInput
from tpserve.server.images import decode_image
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.validation import Limits
from tpserve.v1 import serving_pb2

NUM_STEPS = 6
GREEDY = SamplingParams()
LIMITS = Limits(context_size=4096, vocab_size=320)
SIZES = ((70, 50), (40, 90), (20, 20))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_gemma3v(tmp_path_factory.mktemp("gemma3v")))


def vision_of(model_dir: str) -> tuple[Gemma3VisionInput, Tokenizer]:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    vision = Gemma3VisionInput.from_model_dir(
        model_dir,
        load_model_config(model_dir),
        BOI_TOKEN,
        torch.float32,
        encode_text=lambda text: tokenizer.encode(text, add_bos=False),
        decode_text=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    return vision, tokenizer


def media(data: bytes) -> serving_pb2.Media:
    return serving_pb2.Media(mime_type="image/png", data=data)


def chat_prompt(model_dir: str, images: list[bytes], text: str = "what is in this picture"):
    """A chat's prompt ids as the daemon builds them and its PromptImages; and the template's text."""
    vision, tokenizer = vision_of(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    parts, wheres = [media(data) for data in images], [f"image {n}" for n in range(len(images))]
    ids, placed = vision.expand(ids, len(images), parts, wheres, LIMITS)
    return tuple(ids), vision.read(parts, placed, wheres, LIMITS), tokenizer.render_chat(messages, True)


def run_prompts(model_dir, prompts, images, tp_rank=0, tp_size=1, collectives=None, chunks=()):
    """Prefill `prompts` (images: each prompt's PromptImages; a follower's hold no features) in one
    pass, or one prompt in passes ending at `chunks`; then NUM_STEPS greedy rounds."""
    engine = tiny_engine(model_dir, 2048, tp_rank, tp_size, collectives)

    def placed(prompt_images, start, length):
        runs, rows = media_in_chunk(prompt_images, start, length)
        return [offset + k for offset, length in runs for k in range(length)], rows

    if chunks:
        (prompt,), (prompt_images,) = prompts, images
        open_lane(engine, 0, 300)
        for start, end in zip((0, *chunks), (*chunks, len(prompt))):
            rows, features = placed(prompt_images, start, end - start)
            media_rows = torch.cat(features) if features and tp_rank == 0 else None
            logits = engine.forward([(0, start, prompt[start:end])], media_rows=[rows], media=media_rows)
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


def processor_inputs(model_dir: str, text: str, images: list[bytes]):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    pictures = [Image.open(io.BytesIO(data)) for data in images]
    return processor(text=text, images=pictures, return_tensors="pt")


def transformers_run(model_dir: str, ids, pixels):
    """transformers' logits and greedy tokens for the prompt ids and pixels, each image's tokens
    marked in token_type_ids as Gemma3Processor marks them."""
    from transformers import Gemma3ForConditionalGeneration

    reference = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == IMAGE_TOKEN_ID).long()
    return cached_greedy(
        reference, NUM_STEPS, input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids
    )


def test_the_prompt_and_pixels_are_the_processors(model_dir):
    images = [block_image(1, SIZES[0]), block_image(2, SIZES[1])]
    ids, prompt_images, text = chat_prompt(model_dir, images)
    theirs = processor_inputs(model_dir, text, images)
    assert list(ids) == theirs["input_ids"][0].tolist()
    assert [image.offset for image in prompt_images] == [
        at for at, t in enumerate(ids) if t == IMAGE_TOKEN_ID and ids[at - 1] != IMAGE_TOKEN_ID
    ]
    assert all(image.num_tokens == TOKENS_PER_IMAGE and image.whole for image in prompt_images)
    vision, _ = vision_of(model_dir)
    for data, pixels in zip(images, theirs["pixel_values"]):
        ours = vision.preprocessor.pixels(decode_image(data, "image", 10**6))
        np.testing.assert_allclose(ours, pixels.numpy(), rtol=0, atol=1e-6)


def test_logits_and_greedy_tokens_match_transformers(model_dir):
    torch.set_num_threads(1)
    images = [block_image(1, SIZES[0]), block_image(2, SIZES[1])]
    ids, prompt_images, text = chat_prompt(model_dir, images)
    pixels = processor_inputs(model_dir, text, images)["pixel_values"]
    theirs_logits, theirs_tokens = transformers_run(model_dir, ids, pixels)
    ours_logits, ours_tokens = run_prompts(model_dir, [ids], [prompt_images])
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens
    # In chunks that keep each image whole: one ends just after the first image, one just before
    # the second, one just after it (one starting inside an image after a cached prefix: the
    # daemon's cached turn, tests/test_gemma3v_daemon.py).
    first, second = (image.offset for image in prompt_images)
    cuts = (3, first + TOKENS_PER_IMAGE, second, second + TOKENS_PER_IMAGE, second + TOKENS_PER_IMAGE + 1)
    chunked, chunked_tokens = run_prompts(model_dir, [ids], [prompt_images], chunks=cuts)
    torch.testing.assert_close(chunked[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert chunked_tokens == ours_tokens
    # The images' rows seeing each other changed the logits: transformers without token_type_ids
    # (plain causal attention) reads otherwise.
    from transformers import Gemma3ForConditionalGeneration

    reference = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        causal = reference(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0, -1]
    assert (causal - theirs_logits[0]).abs().max() > 1e-3


def test_a_batch_with_and_without_images_equals_each_solo_run(model_dir):
    check_batch_equals_solo(run_prompts, chat_prompt, model_dir, (SIZES[0], SIZES[2]))


def test_tp2_equals_tp1_bit_for_bit_with_images(model_dir):
    torch.set_num_threads(1)
    ids, prompt_images, _ = chat_prompt(model_dir, [block_image(4, SIZES[1])])
    check_tp2_equals_tp1(run_prompts, model_dir, ids, prompt_images)


def test_pan_and_scan_is_refused_by_name(tmp_path):
    model_dir = write_tiny_gemma3v(tmp_path / "pan", do_pan_and_scan=True)
    with pytest.raises(ModelFileError, match="do_pan_and_scan"):
        vision_of(str(model_dir))


def test_a_config_as_google_writes_it_takes_transformers_defaults():
    # gemma-3-4b-it's config.json: a text_config of few keys, the token ids at the top level
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    config = parse_model_config(raw)
    assert (config.family, config.num_heads, config.num_kv_heads, config.head_dim) == ("gemma3", 8, 4, 256)
    assert config.vocab_size == 262_208 and config.eos_token_ids == (1, 106) and config.tie_word_embeddings
    assert config.windows == tuple(0 if (layer + 1) % 6 == 0 else 1024 for layer in range(34))
    assert config.rope_theta == 1_000_000.0 and config.rope_scaling.factor == 8.0
    assert config.gemma3.local_theta == 10_000.0 and config.gemma3.query_pre_attn_scalar == 256
    vision = config.vision
    assert (vision.patches_per_side, vision.pool_size, vision.tokens_per_image) == (64, 4, 256)
    assert (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id) == (262144, 255999, 256000)
    with pytest.raises(ModelFileError, match="mm_tokens_per_image"):
        parse_model_config(raw | {"mm_tokens_per_image": 250})

"""The LLaVA path below the server: preprocessing, the vision tower and the text model with image
features, against transformers' own LlavaForConditionalGeneration; tp=2 against tp=1 bit for bit;
a batch with and without images against each prompt's solo run."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from hf_reference import cached_greedy
from multiproc import RankPool, world_collectives
from PIL import Image
from safetensors.torch import load_file, save_file
from test_tp_exact import decode_steps
from tiny_llava import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, block_image, write_tiny_llava

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.leader import media_in_chunk
from tpserve.ranks.model_config import load_model_config, parse_model_config
from tpserve.ranks.vision import load_vision_tower
from tpserve.server.images import Preprocessor, decode_image
from tpserve.server.requests import PromptImage

NUM_STEPS = 8
GREEDY = SamplingParams()
TEXT = (40, 41, 42)


def image_prompt(before=TEXT, after=(50, 51)) -> tuple[tuple[int, ...], int]:
    """Token ids with one image's positions, and where they start."""
    return (*before, *[IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE, *after), len(before)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return str(write_tiny_llava(tmp_path_factory.mktemp("llava")))


def pixels_of(model_dir: str, data: bytes):
    return Preprocessor.from_model_dir(model_dir).pixels(decode_image(data, "image", 1 << 20))


def features_of(model_dir: str, data: bytes) -> torch.Tensor:
    config = load_model_config(model_dir)
    tower = load_vision_tower(model_dir, config.vision, torch.float32)
    return tower.features(pixels_of(model_dir, data))


def run_prompts(model_dir, prompts, images, tp_rank=0, tp_size=1, collectives=None, features=None, chunk=0):
    """Prefill `prompts` in one pass (images: per prompt, (offset, image bytes) or None; with
    `chunk`, one prompt in passes of that many tokens), then NUM_STEPS greedy rounds; the logits
    of every step and the tokens (rank 0)."""
    engine = tiny_engine(model_dir, 1024, tp_rank, tp_size, collectives)
    spans, media_rows, media = [], [], []
    for lane, (prompt, image) in enumerate(zip(prompts, images)):
        open_lane(engine, lane, 200)
        spans.append((lane, 0, prompt))
        prompt_images = ()
        if image is not None:
            offset, data = image
            rows = features.get(data) if features is not None else features_of(model_dir, data)
            if rows is None:  # a follower: it holds no features, only where they go
                rows = torch.empty(TOKENS_PER_IMAGE, 0)
            prompt_images = (PromptImage(offset, TOKENS_PER_IMAGE, -1, rows),)
        runs, feature_rows = media_in_chunk(prompt_images, 0, len(prompt))
        media_rows.append([offset + k for offset, length in runs for k in range(length)])
        media += feature_rows
    if chunk:  # one prompt, its image cut wherever the chunks fall
        (prompt,) = prompts
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            runs, rows = media_in_chunk(prompt_images, start, len(piece))
            chunk_rows = [offset + k for offset, length in runs for k in range(length)]
            chunk_media = torch.cat(rows) if rows else None
            logits = engine.forward([(0, start, piece)], media_rows=[chunk_rows], media=chunk_media)
    else:
        rank0_media = torch.cat(media) if media and tp_rank == 0 else None
        logits = engine.forward(spans, media_rows=media_rows, media=rank0_media)
    positions = [len(p) for p in prompts]
    return decode_steps(engine, logits, positions, [GREEDY] * len(prompts), tp_rank, tp_size, NUM_STEPS)


def test_preprocessing_matches_transformers_clip_processor(llava_dir):
    from transformers import CLIPImageProcessorPil

    theirs_processor = CLIPImageProcessorPil.from_pretrained(llava_dir)
    for size, fmt in (((40, 34), "PNG"), ((30, 30), "WEBP"), ((17, 61), "JPEG")):
        data = block_image(3, size, fmt)
        ours = torch.from_numpy(pixels_of(llava_dir, data))
        theirs = theirs_processor(images=Image.open(io.BytesIO(data)), return_tensors="pt")
        torch.testing.assert_close(ours, theirs["pixel_values"][0], rtol=0, atol=1e-5)


def test_logits_and_greedy_tokens_match_transformers(llava_dir):
    from transformers import LlavaForConditionalGeneration

    torch.set_num_threads(1)
    data = block_image(1)
    prompt, offset = image_prompt()
    ours_logits, ours_tokens = run_prompts(llava_dir, [prompt], [(offset, data)])
    reference = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    pixels = torch.from_numpy(pixels_of(llava_dir, data)).unsqueeze(0)
    ids = torch.tensor([prompt])
    theirs_logits, theirs_tokens = cached_greedy(reference, NUM_STEPS, input_ids=ids, pixel_values=pixels)
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens
    # In chunks that cut the image (as a long prompt's prefill, or a cached prefix, does).
    chunked_logits, chunked_tokens = run_prompts(llava_dir, [prompt], [(offset, data)], chunk=7)
    torch.testing.assert_close(chunked_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in chunked_tokens] == theirs_tokens
    # The image changed the reply's logits: the features really went in.
    text_logits, _ = run_prompts(llava_dir, [prompt], [None])
    assert (text_logits[0, 0] - ours_logits[0, 0]).abs().max() > 1e-2


def test_a_batch_with_and_without_images_equals_each_solo_run(llava_dir):
    torch.set_num_threads(1)
    first, first_at = image_prompt()
    second, second_at = image_prompt(before=(60,) * 9, after=(61, 62, 63))
    prompts = [first, (70, 71, 72, 73, 74), second, first]
    images = [(first_at, block_image(1)), None, (second_at, block_image(2)), (first_at, block_image(2))]
    together, _ = run_prompts(llava_dir, prompts, images)
    for lane, (prompt, image) in enumerate(zip(prompts, images)):
        alone, _ = run_prompts(llava_dir, [prompt], [image])
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"
    assert not torch.equal(together[:, 0], together[:, 3])  # same tokens, another image


def _tp2(ctx, model_dir, prompts, images, features, choice):
    torch.set_num_threads(1)
    collectives = world_collectives(ctx, choice)
    # Rank 0 alone holds the features (the server's vision tower runs there); rank 1 gets none.
    return run_prompts(
        model_dir, prompts, images, ctx.rank, 2, collectives, features if ctx.rank == 0 else {}
    )


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("choice", ["gloo", "shared_memory"])
def test_tp2_equals_tp1_bit_for_bit_with_images(pool, llava_dir, choice):
    torch.set_num_threads(1)
    first, first_at = image_prompt()
    prompts = [first, (70, 71, 72)]
    images = [(first_at, block_image(4)), None]
    features = {block_image(4): features_of(llava_dir, block_image(4))}
    solo_logits, solo_tokens = run_prompts(llava_dir, prompts, images, features=features)
    pair_logits, pair_tokens = pool.run(_tp2, llava_dir, prompts, images, features, choice, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)


def test_the_newer_checkpoint_naming_loads_the_same_model(llava_dir, tmp_path):
    # transformers 4 wrote language_model.model.* and vision_tower.*; checkpoints converted for the
    # newer layout hold model.language_model.*, model.vision_tower.*, lm_head.*.
    renamed = tmp_path / "renamed"
    shutil.copytree(llava_dir, renamed)
    tensors = load_file(str(renamed / "model.safetensors"))
    prefixes = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.": "model.vision_tower.vision_model.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    out = {}
    for name, tensor in tensors.items():
        old = next(prefix for prefix in prefixes if name.startswith(prefix))
        out[prefixes[old] + name.removeprefix(old)] = tensor
    save_file(out, str(renamed / "model.safetensors"))
    prompt, offset = image_prompt()
    expected, _ = run_prompts(llava_dir, [prompt], [(offset, block_image(9))])
    got, _ = run_prompts(str(renamed), [prompt], [(offset, block_image(9))])
    assert torch.equal(expected, got)


def test_an_unsupported_vision_tower_is_refused_by_name(llava_dir, tmp_path):
    raw = json.loads((Path(llava_dir) / "config.json").read_text())
    raw["vision_config"]["model_type"] = "siglip_vision_model"
    with pytest.raises(ModelFileError, match="vision tower 'siglip_vision_model' is not supported"):
        parse_model_config(raw)

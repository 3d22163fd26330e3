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
from hf_reference import cached_greedy
from multiproc import RankPool, world_collectives
from PIL import Image
from test_qwen_vl import NUM_STEPS, image_prompt, run_prompts
from tiny_llava import block_image
from tiny_qwen3_vl import write_tiny_qwen3_vl
from tiny_qwen_vl import IMAGE_TOKEN_ID

from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.mrope import section_axes
from tpserve.ranks.qwen3_vision import load_qwen3_vision_tower
from tpserve.server.images import decode_image
from tpserve.server.qwen_images import QwenPreprocessor

SIZES = ((70, 50), (40, 90))  # (width, height): 10x6 and 6x12 patch grids of 8 pixels, past the 4x4 table


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl")))


def image_of(model_dir: str, data: bytes):
    """(features [tokens, hidden * 2]: merged and deepstack side by side, merged (rows, columns))."""
    config = load_model_config(model_dir)
    patches, grid = QwenPreprocessor.from_model_dir(model_dir).patches(decode_image(data, "image", 1 << 20))
    features = load_qwen3_vision_tower(model_dir, config.vision, torch.float32).features(patches, grid)
    merge = config.vision.spatial_merge_size
    return features, (grid[1] // merge, grid[2] // merge)


def test_logits_and_greedy_tokens_match_transformers(model_dir):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

    torch.set_num_threads(1)
    data = block_image(1, SIZES[0])
    features, merged = image_of(model_dir, data)
    assert features.shape[1] == 2 * load_model_config(model_dir).hidden_size  # one deepstack merger
    prompt, offset = image_prompt(merged)
    ours_logits, ours_tokens = run_prompts(model_dir, [prompt], [(offset, features, merged)])
    reference = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt"
    )
    ids = torch.tensor([prompt])
    theirs_logits, theirs_tokens = cached_greedy(
        reference,
        NUM_STEPS,
        input_ids=ids,
        pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"],
        mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
    )
    torch.testing.assert_close(ours_logits[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens
    # In chunks that cut the image (a long prompt's prefill, or a cached prefix, does).
    chunked, chunked_tokens = run_prompts(model_dir, [prompt], [(offset, features, merged)], chunk=11)
    torch.testing.assert_close(chunked[:, 0], theirs_logits, rtol=0, atol=1e-4)
    assert chunked_tokens == ours_tokens
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
    second = image_of(model_dir, block_image(2, SIZES[1]))
    one, one_at = image_prompt(first[1])
    two, two_at = image_prompt(second[1], before=(60,) * 7, after=(61,))
    prompts = [one, (70, 71, 72, 73, 74), two]
    images = [(one_at, first[0], first[1]), None, (two_at, second[0], second[1])]
    together, _ = run_prompts(model_dir, prompts, images)
    for lane, (prompt, image) in enumerate(zip(prompts, images)):
        alone, _ = run_prompts(model_dir, [prompt], [image])
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"


def _tp2(ctx, model_dir, prompts, images):
    torch.set_num_threads(1)
    collectives = world_collectives(ctx, "gloo")
    if ctx.rank:  # a follower holds no features, deepstack's neither: only where they go and the positions
        images = [None if i is None else (i[0], None, i[2]) for i in images]
    return run_prompts(model_dir, prompts, images, ctx.rank, 2, collectives)


def test_tp2_equals_tp1_bit_for_bit_with_images(model_dir):
    torch.set_num_threads(1)
    features, merged = image_of(model_dir, block_image(4, SIZES[0]))
    prompt, offset = image_prompt(merged)
    prompts, images = [prompt, (70, 71, 72)], [(offset, features, merged), None]
    solo_logits, solo_tokens = run_prompts(model_dir, prompts, images)
    with RankPool(2) as pool:
        pair_logits, pair_tokens = pool.run(_tp2, model_dir, prompts, images, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)

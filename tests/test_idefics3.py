"""The Idefics3 and SmolVLM image path below the server, on tiny random models transformers writes
(tests/tiny_idefics3.py): the tiles against transformers' Idefics3 image processor (its PIL backend:
torchvision, which the default one needs, has no build here), the prompt ids against Idefics3Processor
(SmolVLM's image text against its processor's own function: building SmolVLMProcessor needs its video
processor, so torchvision, too), the tower's features and the logits and greedy tokens against
transformers' forward on the same pixels, in one pass and in chunks that cut the tiles; tp=2 against
tp=1 bit for bit; a batch with and without images against each prompt's solo run."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from engine_lanes import open_lane, tiny_engine
from hf_reference import cached_greedy
from multiproc import RankPool, world_collectives
from PIL import Image
from test_tp_exact import decode_steps
from tiny_idefics3 import (
    ARCHITECTURES,
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_SEQ_LEN,
    IMAGE_TOKEN,
    IMAGE_TOKEN_ID,
    write_tiny_idefics3,
)
from tiny_llava import block_image

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.leader import media_in_chunk
from tpserve.ranks.model_config import load_model_config, parse_model_config
from tpserve.ranks.siglip_vision import bucketed_positions
from tpserve.server.idefics3_images import Idefics3Preprocessor
from tpserve.server.idefics3_input import Idefics3VisionInput, image_prompt
from tpserve.server.images import decode_image
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.validation import Limits, RequestRefused
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


def test_tiles_match_transformers_image_processor(model_dir, one_tile_dir):
    from transformers import Idefics3ImageProcessorPil

    for directory in (model_dir, one_tile_dir):
        ours = Idefics3Preprocessor.from_model_dir(directory)
        theirs = Idefics3ImageProcessorPil.from_pretrained(directory)
        for size, fmt in zip((*SIZES, (1, 200)), ("PNG", "WEBP", "JPEG", "PNG", "PNG")):
            data = block_image(3, size, fmt)
            tiles, layout = ours.tiles(decode_image(data, "image", 1 << 20))
            out = theirs(images=Image.open(io.BytesIO(data)), return_tensors="pt", return_row_col_info=True)
            assert (layout.rows, layout.cols) == (out["rows"][0][0], out["cols"][0][0])
            assert bool(out["pixel_attention_mask"].all())  # every tile whole: nothing for the tower to mask
            torch.testing.assert_close(torch.from_numpy(tiles), out["pixel_values"][0], rtol=0, atol=1e-6)


def test_prompt_ids_match_idefics3_processor(model_dir, one_tile_dir):
    from transformers import Idefics3Processor
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    for directory in (model_dir, one_tile_dir):
        processor = Idefics3Processor.from_pretrained(directory)
        vision, tokenizer = vision_of(directory)
        images = [block_image(1, SIZES[0]), block_image(2, SIZES[2])]
        ids, _ = chat_prompt(directory, images, "hello world")
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hello world"}]
        rendered = tokenizer.render_chat([{"role": "user", "content": content}], add_generation_prompt=True)
        theirs = processor(text=rendered, images=[[Image.open(io.BytesIO(d)) for d in images]])
        assert list(ids) == theirs["input_ids"][0]
        for size in SIZES:  # SmolVLMProcessor writes the same text for an image
            layout = vision.preprocessor.layout(size[1], size[0])
            smolvlm = get_image_prompt_string(
                layout.rows, layout.cols, IMAGE_SEQ_LEN, FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN
            )
            assert image_prompt(layout, IMAGE_TOKEN, IMAGE_SEQ_LEN) == smolvlm


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
    torch.set_num_threads(1)
    first = chat_prompt(model_dir, [block_image(1, SIZES[0])])
    second = chat_prompt(model_dir, [block_image(2, SIZES[2])], "the lazy dog")
    other = chat_prompt(model_dir, [block_image(3, SIZES[0])])  # the first's tokens, another image
    prompts = [first[0], (70, 71, 72, 73, 74), second[0], other[0]]
    images = [first[1], (), second[1], other[1]]
    together, _ = run_prompts(model_dir, prompts, images)
    for lane, (prompt, prompt_images) in enumerate(zip(prompts, images)):
        alone, _ = run_prompts(model_dir, [prompt], [prompt_images])
        assert torch.equal(together[:, lane], alone[:, 0]), f"stream {lane} differs from its solo run"
    assert first[0] == other[0] and not torch.equal(together[:, 0], together[:, 3])


def _tp2(ctx, model_dir, prompts, images):
    torch.set_num_threads(1)
    collectives = world_collectives(ctx, "gloo")
    return run_prompts(model_dir, prompts, images, ctx.rank, 2, collectives)


def test_tp2_equals_tp1_bit_for_bit_with_images(model_dir):
    torch.set_num_threads(1)
    ids, prompt_images = chat_prompt(model_dir, [block_image(4, SIZES[1])])
    prompts, images = [ids, (70, 71, 72)], [prompt_images, ()]
    solo_logits, solo_tokens = run_prompts(model_dir, prompts, images)
    with RankPool(2) as pool:
        pair_logits, pair_tokens = pool.run(_tp2, model_dir, prompts, images, timeout_s=120)[0]
    assert pair_tokens == solo_tokens
    torch.testing.assert_close(pair_logits, solo_logits, rtol=0, atol=0)


def test_a_video_part_is_refused_by_name(model_dir):
    vision, tokenizer = vision_of(model_dir)
    ids = tokenizer.encode_chat([{"role": "user", "content": [{"type": "image"}]}])
    video = serving_pb2.Media(mime_type="video/mp4", data=b"\x00" * 64)
    with pytest.raises(RequestRefused, match="video input is not implemented"):
        vision.expand(ids, 1, [video], ["messages[0].parts[0]"], LIMITS)


def test_glm4v_is_refused_by_name():
    for architecture, what in (
        ("Glm4vForConditionalGeneration", "GLM-4.1V"),
        ("Glm4vMoeForConditionalGeneration", "GLM-4.5V"),
    ):
        with pytest.raises(ModelFileError, match=f"{architecture} is not supported: {what}"):
            parse_model_config({"architectures": [architecture]})


def test_transformers4_layout_reads_the_same(model_dir, tmp_path):
    # transformers 4 wrote preprocessor_config.json (the image processor's fields) and a
    # processor_config.json holding only the processor's own (image_seq_len).
    old = tmp_path / "v4"
    shutil.copytree(model_dir, old)
    processor = json.loads((old / "processor_config.json").read_text())
    (old / "preprocessor_config.json").write_text(json.dumps(processor.pop("image_processor")))
    (old / "processor_config.json").write_text(json.dumps(processor))
    images = [block_image(6, SIZES[1])]
    (ids, new_images), (old_ids, old_images) = chat_prompt(model_dir, images), chat_prompt(str(old), images)
    assert ids == old_ids
    assert all(torch.equal(a.features, b.features) for a, b in zip(new_images, old_images))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("image_seq_len", 9, "image_seq_len 9 is not the tower's 4 tokens a tile"),
        ("max_image_size", {"longest_edge": 48}, "max_image_size.longest_edge 48 is not the vision tower's"),
    ],
)
def test_a_processor_that_disagrees_with_the_tower_stops_start_up(model_dir, tmp_path, field, value, message):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    processor = json.loads((broken / "processor_config.json").read_text())
    (processor if field == "image_seq_len" else processor["image_processor"])[field] = value
    (broken / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ModelFileError, match=re.escape(message)):
        vision_of(str(broken))


def test_a_scale_factor_that_does_not_divide_the_tile_is_refused(model_dir):
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    raw["scale_factor"] = 3
    with pytest.raises(ModelFileError, match="scale_factor 3 does not divide the tile's 4 patches a side"):
        parse_model_config(raw)


def test_a_tokenizer_without_the_image_token_whole_stops_start_up(model_dir):
    # A tokenizer that reads "<image>" as text, as one without it among its added tokens would.
    tokenizer = Tokenizer.from_model_dir(model_dir)
    config = load_model_config(model_dir)
    with pytest.raises(ModelFileError, match="does not keep '<image>' whole"):
        Idefics3VisionInput.from_model_dir(
            model_dir,
            config,
            IMAGE_TOKEN,
            torch.float32,
            encode_text=lambda text: tokenizer.encode(text.replace(IMAGE_TOKEN, "<image >")),
        )


def test_patch_positions_are_bucketed_as_transformers_does():
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    side = 7  # the table's patches a side; grids of other sizes land in its buckets
    embeddings = Idefics3VisionEmbeddings(
        Idefics3VisionConfig(hidden_size=1, image_size=side * 2, patch_size=2)
    )
    with torch.no_grad():  # each patch's output is its position row's index
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
    for rows, cols in ((7, 7), (3, 5), (9, 2), (1, 13)):
        mask = torch.zeros(1, 13, 13, dtype=torch.bool)
        mask[0, :rows, :cols] = True  # a smaller image padded: its own patches only
        with torch.no_grad():
            out = embeddings(torch.zeros(1, 3, 26, 26), mask)[0, :, 0].view(13, 13)[:rows, :cols]
        assert out.flatten().long().tolist() == bucketed_positions(rows, cols, side).tolist()

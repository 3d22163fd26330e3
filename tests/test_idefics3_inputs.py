"""The Idefics3 and SmolVLM inputs on the server's side, on the tiny models tests/tiny_idefics3.py
writes: the tiles against transformers' Idefics3 image processor (its PIL backend: torchvision, which the
default one needs, has no build here), the prompt ids against Idefics3Processor (SmolVLM's image text
against its processor's own function: building SmolVLMProcessor needs its video processor, so
torchvision, too), the patch positions against transformers' embedding; what start-up refuses (a
processor or tokenizer that disagrees with the tower) and a video part, refused by name."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_idefics3 import LIMITS, SIZES, chat_prompt, vision_of
from tiny_idefics3 import (
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_SEQ_LEN,
    IMAGE_TOKEN,
    write_tiny_idefics3,
)
from tiny_llava import block_image

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import load_model_config, parse_model_config
from tpserve.ranks.siglip_vision import bucketed_positions
from tpserve.server.idefics3_images import Idefics3Preprocessor
from tpserve.server.idefics3_input import Idefics3VisionInput, image_prompt
from tpserve.server.images import decode_image
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.validation import RequestRefused
from tpserve.v1 import serving_pb2


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> tuple[str, str]:
    """A tiny Idefics3 whose processor splits images into tiles, and one whose processor does not."""
    return tuple(
        str(write_tiny_idefics3(tmp_path_factory.mktemp(name), splitting=splitting))
        for name, splitting in (("idefics3-tiles", True), ("idefics3-whole", False))
    )


def test_tiles_match_transformers_image_processor(directories):
    from transformers import Idefics3ImageProcessorPil

    for directory in directories:
        ours = Idefics3Preprocessor.from_model_dir(directory)
        theirs = Idefics3ImageProcessorPil.from_pretrained(directory)
        for size, fmt in zip((*SIZES, (1, 200)), ("PNG", "WEBP", "JPEG", "PNG", "PNG")):
            data = block_image(3, size, fmt)
            tiles, layout = ours.tiles(decode_image(data, "image", 1 << 20))
            out = theirs(images=Image.open(io.BytesIO(data)), return_tensors="pt", return_row_col_info=True)
            assert (layout.rows, layout.cols) == (out["rows"][0][0], out["cols"][0][0])
            assert bool(out["pixel_attention_mask"].all())  # every tile whole: nothing for the tower to mask
            torch.testing.assert_close(torch.from_numpy(tiles), out["pixel_values"][0], rtol=0, atol=1e-6)


def test_prompt_ids_match_idefics3_processor(directories):
    from transformers import Idefics3Processor
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    for directory in directories:
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


def test_a_video_part_is_refused_by_name(directories):
    model_dir = directories[0]
    vision, tokenizer = vision_of(model_dir)
    ids = tokenizer.encode_chat([{"role": "user", "content": [{"type": "image"}]}])
    video = serving_pb2.Media(mime_type="video/mp4", data=b"\x00" * 64)
    with pytest.raises(RequestRefused, match="video input is not implemented"):
        vision.expand(ids, 1, [video], ["messages[0].parts[0]"], LIMITS)


def test_transformers4_layout_reads_the_same(directories, tmp_path):
    model_dir = directories[0]
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
def test_a_processor_that_disagrees_with_the_tower_stops_start_up(
    directories, tmp_path, field, value, message
):
    model_dir = directories[0]
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    processor = json.loads((broken / "processor_config.json").read_text())
    (processor if field == "image_seq_len" else processor["image_processor"])[field] = value
    (broken / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ModelFileError, match=re.escape(message)):
        vision_of(str(broken))


def test_a_scale_factor_that_does_not_divide_the_tile_is_refused(directories):
    model_dir = directories[0]
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    raw["scale_factor"] = 3
    with pytest.raises(ModelFileError, match="scale_factor 3 does not divide the tile's 4 patches a side"):
        parse_model_config(raw)


def test_a_tokenizer_without_the_image_token_whole_stops_start_up(directories):
    model_dir = directories[0]
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


def test_a_tokenizer_that_strips_beside_the_image_text_stops_start_up(directories):
    # As an added token with rstrip would: the space after the image's last token vanishes.
    tokenizer = Tokenizer.from_model_dir(directories[0])
    config = load_model_config(directories[0])
    with pytest.raises(ModelFileError, match="reads an image's text otherwise beside other text"):
        Idefics3VisionInput.from_model_dir(
            directories[0],
            config,
            IMAGE_TOKEN,
            torch.float32,
            encode_text=lambda text: tokenizer.encode(
                text.replace(FAKE_TOKEN + " ", FAKE_TOKEN), add_bos=False
            ),
        )

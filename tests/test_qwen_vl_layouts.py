"""Qwen2.5-VL checkpoints as transformers 4 and 5 lay them out: transformers 5's one
processor_config.json reads as the image processor's own file; transformers 4's flat config.json
(the decoder's keys at the top, the mrope sections as a rope_scaling of type "mrope") parses to the
same model; what cannot be served is refused by name."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import grpc
import pytest
from PIL import Image
from tiny_llava import block_image
from tiny_qwen3_vl import write_tiny_qwen3_vl
from tiny_qwen_vl import write_tiny_qwen_vl

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import load_model_config, parse_model_config
from tpserve.server.images import decode_image
from tpserve.server.qwen_images import QwenPreprocessor
from tpserve.server.validation import RequestRefused


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return str(write_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl")))


def test_a_processor_config_json_reads_as_the_image_processors_own_file(qwen_dir, tmp_path):
    # transformers 5's Qwen2_5_VLProcessor.save_pretrained needs torchvision (its video processor),
    # which the tests do not install: the file is written here in its layout, the image processor's
    # own to_dict() under "image_processor", and no preprocessor_config.json.
    from transformers import Qwen2VLImageProcessorPil

    whole = tmp_path / "whole"
    shutil.copytree(qwen_dir, whole)
    settings = Qwen2VLImageProcessorPil.from_pretrained(qwen_dir).to_dict()
    (whole / "preprocessor_config.json").unlink()
    (whole / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    assert QwenPreprocessor.from_model_dir(whole) == QwenPreprocessor.from_model_dir(qwen_dir)


def test_a_transformers_4_flat_config_parses_to_the_same_model(qwen_dir):
    raw = json.loads((Path(qwen_dir) / "config.json").read_text())
    text = raw.pop("text_config")
    section = text.pop("rope_parameters")["mrope_section"]
    flat = {**raw, **text, "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": section}}
    flat["model_type"] = "qwen2_5_vl"
    assert parse_model_config(flat) == load_model_config(qwen_dir)


def test_a_wrong_mrope_section_is_refused_by_name(qwen_dir):
    raw = json.loads((Path(qwen_dir) / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ModelFileError, match=r"mrope_section \[2, 3, 4\] must be three numbers summing to"):
        parse_model_config(raw)


def test_smart_resize_keeps_the_pixel_bounds_and_refuses_a_sliver(qwen_dir):
    pre = QwenPreprocessor.from_model_dir(qwen_dir)
    big = io.BytesIO()
    Image.new("RGB", (400, 300)).save(big, format="PNG")
    patches, grid = pre.patches(decode_image(big.getvalue(), "image", 1 << 20))
    pixels = grid[1] * grid[2] * pre.patch_size**2
    assert pre.min_pixels <= pixels <= pre.max_pixels and patches.shape[0] == grid[1] * grid[2]
    sliver = io.BytesIO()
    Image.new("RGB", (1, 250)).save(sliver, format="PNG")
    with pytest.raises(RequestRefused, match="more than 200 times as long as it is wide") as refused:
        pre.patches(decode_image(sliver.getvalue(), "image", 1 << 20))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert pre.patches(decode_image(block_image(1, (13, 9)), "image", 1 << 20))[1] == (1, 2, 2)  # min_pixels


def test_a_qwen3_vl_moe_checkpoint_is_refused_by_name_at_load(tmp_path):
    # The dense Qwen3-VL loads; its mixture-of-experts sibling (the same layout, experts in the text
    # model) is refused at start-up, saying what is missing.
    raw = json.loads((write_tiny_qwen3_vl(tmp_path / "qwen3-vl") / "config.json").read_text())
    raw["architectures"] = ["Qwen3VLMoeForConditionalGeneration"]
    with pytest.raises(
        ModelFileError, match="Qwen3VLMoeForConditionalGeneration is not supported: .*experts"
    ):
        parse_model_config(raw)

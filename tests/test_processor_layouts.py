"""A LLaVA checkpoint as the installed transformers (5.x) saves it, processor included: one
processor_config.json (the image processor's settings under "image_processor"), the chat template in
chat_template.jinja, no preprocessor_config.json. It loads as transformers 4's layout does and
serves an image chat matching transformers' own processor and model."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_vision import NUM_STEPS, pixels_of, run_prompts
from tiny_llava import IMAGE_TOKEN, block_image, write_tiny_llava, write_tiny_llava_processor

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import load_model_config
from tpserve.server.images import Preprocessor
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.vision_input import VisionInput

MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in this picture"}]}
]


@pytest.fixture(scope="module")
def v5_dir(tmp_path_factory) -> str:
    return str(write_tiny_llava_processor(tmp_path_factory.mktemp("llava5")))


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory) -> str:
    return str(write_tiny_llava(tmp_path_factory.mktemp("llava4")))


def test_transformers_saves_the_processor_in_one_processor_config(v5_dir):
    files = {path.name for path in Path(v5_dir).iterdir()}
    assert "processor_config.json" in files and "preprocessor_config.json" not in files
    assert "chat_template.jinja" in files
    saved = json.loads((Path(v5_dir) / "processor_config.json").read_text())
    assert saved["image_processor"]["size"] == {"shortest_edge": 30}


def test_both_layouts_give_the_same_preprocessing(v4_dir, v5_dir):
    assert Preprocessor.from_model_dir(v5_dir) == Preprocessor.from_model_dir(v4_dir)


def test_pixels_and_prompt_match_transformers_own_processor(v5_dir):
    from transformers import LlavaProcessor

    processor = LlavaProcessor.from_pretrained(v5_dir)
    tokenizer = Tokenizer.from_model_dir(v5_dir)  # the template from chat_template.jinja
    config = load_model_config(v5_dir)
    vision = VisionInput.from_model_dir(v5_dir, config, IMAGE_TOKEN, torch.float32)
    text = tokenizer.render_chat(MESSAGES)
    for size, fmt in (((40, 34), "PNG"), ((17, 61), "JPEG")):
        data = block_image(5, size, fmt)
        theirs = processor(text=text, images=Image.open(io.BytesIO(data)), return_tensors="pt")
        ours = torch.from_numpy(pixels_of(v5_dir, data))
        torch.testing.assert_close(ours, theirs["pixel_values"][0], rtol=0, atol=1e-5)
        ids, offsets = vision.expand(tokenizer.encode_chat(MESSAGES), 1)
        assert ids == theirs["input_ids"][0].tolist() and len(offsets) == 1


def test_an_image_chat_on_the_transformers5_checkpoint_matches_transformers(v5_dir):
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    torch.set_num_threads(1)
    data = block_image(2)
    tokenizer = Tokenizer.from_model_dir(v5_dir)
    vision = VisionInput.from_model_dir(v5_dir, load_model_config(v5_dir), IMAGE_TOKEN, torch.float32)
    prompt, (place,) = vision.expand(tokenizer.encode_chat(MESSAGES), 1)
    ours_logits, ours_tokens = run_prompts(v5_dir, [tuple(prompt)], [(place.offset, data)])
    processor = LlavaProcessor.from_pretrained(v5_dir)
    inputs = processor(
        text=tokenizer.render_chat(MESSAGES), images=Image.open(io.BytesIO(data)), return_tensors="pt"
    )
    reference = LlavaForConditionalGeneration.from_pretrained(v5_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference(**inputs, use_cache=True)
        theirs_logits, past, theirs_tokens = [out.logits[0, -1]], out.past_key_values, []
        for _ in range(NUM_STEPS - 1):
            theirs_tokens.append(int(theirs_logits[-1].argmax()))
            out = reference(
                input_ids=torch.tensor([[theirs_tokens[-1]]]), past_key_values=past, use_cache=True
            )
            theirs_logits.append(out.logits[0, -1])
            past = out.past_key_values
    theirs_tokens.append(int(theirs_logits[-1].argmax()))
    torch.testing.assert_close(ours_logits[:, 0], torch.stack(theirs_logits), rtol=0, atol=1e-4)
    assert [step[0] for step in ours_tokens] == theirs_tokens


def test_a_processor_config_without_image_settings_is_refused_naming_both_files(v5_dir, tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    with pytest.raises(ModelFileError, match="processor_config.json: holds no 'image_processor' object"):
        Preprocessor.from_model_dir(tmp_path)
    (tmp_path / "processor_config.json").unlink()
    with pytest.raises(
        ModelFileError, match="preprocessor_config.json: missing, and so is processor_config.json"
    ):
        Preprocessor.from_model_dir(tmp_path)

"""--vision through the real two-rank daemon on a tiny Qwen2.5-VL: a chat with an image gives
transformers' own greedy tokens, in prompt passes and cache blocks of 16 that cut the image; the same
image hits the prompt cache and another never does; replies beside images equal their solo runs;
broken image bytes and a sliver of an image fail their own request only."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from daemon import running_daemon
from jinja2 import Template
from PIL import Image
from tiny_llava import block_image
from tiny_qwen_vl import CHAT_TEMPLATE, IMAGE_TOKEN_ID, MERGE, write_tiny_qwen_vl
from tokenizers import Tokenizer
from vision_requests import (
    MAX_TOKENS,
    VISION_ARGS,
    check_beside_images,
    check_broken_and_sliver_images,
    check_cache_across_images,
    check_transformers_greedy,
)

SIZE = (61, 83)  # a 14x10 patch grid: 35 image positions in windows cut by the edges


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_tiny_qwen_vl(tmp_path_factory.mktemp("qwen-vl-model"))
    args = (*VISION_ARGS, "--max-image-bytes", "8192", "--max-image-pixels", "16384")
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("qwen-vl-logs"), *args) as daemon:
        daemon.model_dir = model_dir
        yield daemon


def transformers_greedy(model_dir: str, image: bytes, text: str) -> list[int]:
    """transformers' own greedy reply to the same chat: the template, each image pad widened to its
    merged grid, the processor's pixels."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    inputs = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(
        images=Image.open(io.BytesIO(image)), return_tensors="pt"
    )
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    at = ids.index(IMAGE_TOKEN_ID)
    num = int(inputs["image_grid_thw"][0].prod()) // MERGE**2
    ids = torch.tensor([ids[:at] + [IMAGE_TOKEN_ID] * num + ids[at + 1 :]])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, ids.shape[1] :].tolist()


def test_an_image_chat_gives_transformers_greedy_tokens(served):
    check_transformers_greedy(served, SIZE, 35, transformers_greedy)


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    check_cache_across_images(served, SIZE, 4 + 35)  # "<|im_start|>user\n<|vision_start|>" then the image


def test_replies_beside_images_equal_their_solo_runs(served):
    check_beside_images(served, SIZE, (130, 20))


def test_broken_and_sliver_images_fail_their_own_request_only(served):
    check_broken_and_sliver_images(served, block_image(51, SIZE))

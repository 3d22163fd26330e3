"""--vision through the real two-rank daemon on a tiny Gemma3ForConditionalGeneration that transformers
writes (tests/tiny_gemma3v.py): a chat with an image gives transformers' own greedy tokens (prompt
passes of 16 that never cut its 16 image tokens, cache blocks of 16 that do); the same image hits the
prompt cache and repeats the cold reply, another never does; a cache hit that ends inside the image
(the same image, another question) still gives transformers' reply; replies beside images equal their
solo runs; an image over HTTP as a data: URL reads as over gRPC, cold and from the cache; broken image
bytes fail their own request only."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from daemon import running_daemon
from PIL import Image
from tiny_gemma3v import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, write_tiny_gemma3v
from tiny_llava import block_image
from vision_requests import (
    MAX_TOKENS,
    VISION_ARGS,
    ask,
    check_beside_images,
    check_broken,
    check_cache_across_images,
    check_transformers_greedy,
    generate,
    http_chat,
)

from tpserve.server.tokenizer import Tokenizer

SIZE = (70, 50)
QUESTION = "what is in this picture"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_tiny_gemma3v(tmp_path_factory.mktemp("gemma3v-model"))
    with running_daemon("spawn", model_dir, tmp_path_factory.mktemp("gemma3v-logs"), *VISION_ARGS) as daemon:
        daemon.model_dir, daemon.model_name = model_dir, Path(model_dir).name
        yield daemon


def processor_inputs(model_dir: str, image: bytes, text: str):
    """Gemma3Processor's ids, pixels and token_type_ids for the chat the daemon renders."""
    from transformers import AutoProcessor

    content = [{"type": "image"}, {"type": "text", "text": text}]
    rendered = Tokenizer.from_model_dir(model_dir).render_chat([{"role": "user", "content": content}])
    processor = AutoProcessor.from_pretrained(model_dir)
    return processor(text=rendered, images=[Image.open(io.BytesIO(image))], return_tensors="pt")


def transformers_greedy(model_dir: str, image: bytes, text: str) -> list[int]:
    """transformers' own greedy reply to the same chat (Gemma3Processor's prompt and pixels)."""
    from transformers import Gemma3ForConditionalGeneration

    inputs = processor_inputs(model_dir, image, text)
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def image_end(model_dir: str, text: str = QUESTION) -> int:
    """One past the image's last token in the chat's prompt."""
    ids = processor_inputs(model_dir, block_image(11, SIZE), text)["input_ids"][0].tolist()
    return ids.index(IMAGE_TOKEN_ID) + TOKENS_PER_IMAGE


def test_an_image_chat_gives_transformers_greedy_tokens(served):
    check_transformers_greedy(served, SIZE, image_end(served.model_dir), transformers_greedy)


def test_the_same_image_reuses_its_cache_entry_and_another_image_never_does(served):
    check_cache_across_images(served, SIZE, image_end(served.model_dir))


def test_a_cache_hit_ending_inside_the_image_gives_transformers_reply(served):
    image = block_image(12, SIZE)
    end = image_end(served.model_dir)
    assert end % 16 and end > 16  # the image crosses the block boundary at 16
    assert generate(served, ask(image, "hello world")).ok  # its blocks, computed with the image whole
    reply = generate(served, ask(image, "the lazy dog"))
    assert reply.ok, reply.details
    assert 16 <= reply.last.usage.cached_tokens < end  # the hit ends inside the image
    assert reply.token_ids == transformers_greedy(served.model_dir, image, "the lazy dog")


def test_replies_beside_images_equal_their_solo_runs(served):
    check_beside_images(served, SIZE, (40, 90))


def test_an_image_over_http_reads_as_over_grpc_cold_and_cached(served):
    image = block_image(41, (33, 31))
    cold, cached = (http_chat(served, "image", "image/png", image) for _ in range(2))
    assert cold.status_code == cached.status_code == 200, cold.text
    assert cached.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    over_grpc = generate(served, ask(image, "what"))
    texts = [response.json()["choices"][0]["message"]["content"] for response in (cold, cached)]
    assert texts == [over_grpc.text] * 2
    assert cold.json()["usage"]["prompt_tokens"] == over_grpc.last.usage.prompt_tokens


def test_broken_image_bytes_fail_their_own_request_only(served):
    check_broken(served, block_image(51, SIZE), ask, 12)

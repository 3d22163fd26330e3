"""A tiny random LLaVA written by the tests with transformers' own classes: a CLIP vision tower, the
projector and a Llama text model (the tiny Llama's 2+1 KV split), saved with save_pretrained beside
its tokenizer (an `<image>` special token), chat template and CLIP image preprocessor config, in
transformers 4's file layout (preprocessor_config.json, the template in tokenizer_config.json) or,
with write_tiny_llava_processor, as transformers 5's LlavaProcessor.save_pretrained writes it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from PIL import Image
from tiny_models import SPECIAL_TOKENS
from tiny_vlm import chat_template, save_with_tokenizer, scramble, text_settings, train_tokenizer
from tokenizers import Tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = len(SPECIAL_TOKENS)  # the first token after the tiny models' specials
IMAGE_SIZE, PATCH_SIZE = 30, 6
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
CHAT_TEMPLATE = chat_template(IMAGE_TOKEN)


def _tokenizer() -> Tokenizer:
    tokenizer = train_tokenizer([IMAGE_TOKEN])
    assert tokenizer.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return tokenizer


def write_tiny_llava(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    text = LlamaConfig(**text_settings(tokenizer.get_vocab_size()))
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    scramble(model, seed, ("norm", "layrnorm"))
    save_with_tokenizer(out, model, tokenizer, CHAT_TEMPLATE)
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    return out


def write_tiny_llava_processor(out_dir: str | Path, seed: int = 0) -> Path:
    """The same model, its processor saved by the installed transformers' LlavaProcessor: under 5.x,
    one processor_config.json (the image processor's settings under "image_processor"), the chat
    template in chat_template.jinja, and no preprocessor_config.json."""
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    out = write_tiny_llava(out_dir, seed)
    image_processor = CLIPImageProcessor.from_pretrained(out)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token="<|endoftext|>")
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS position, which "default" then drops: 25 tokens
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    for name in ("preprocessor_config.json", "tokenizer_config.json", "tokenizer.json"):
        (out / name).unlink()
    processor.save_pretrained(out)
    return out


def block_image(seed: int, size: tuple[int, int] = (40, 34), fmt: str = "PNG") -> bytes:
    """A small image of coloured blocks, different for each seed, encoded as `fmt`."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (torch.rand(4, 4, 3, generator=gen) * 255).to(torch.uint8).numpy()
    image = Image.fromarray(blocks, "RGB").resize(size, Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()

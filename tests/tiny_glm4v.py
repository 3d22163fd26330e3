"""A tiny random GLM-4.1V written by transformers' own classes (Glm4vConfig, save_pretrained, and
Glm4vImageProcessorPil's own save_pretrained; the torchvision processors need torchvision, which has no
build for this torch here, so its video_preprocessor_config.json is written by hand): a 2-block ViT of width 32 over patches of 8 pixels with a 4x4 learned position
table (image_size 32), the downsample conv and the GLU merger, and a GLM-4 text model (half of each head
rotating, in (t, h, w) sections of (2, 1, 1) frequencies; four norms a layer), beside a tokenizer with
GLM's image and video specials and a chat template writing GLM's image text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_hf_models import GLM4_MOE
from tiny_models import BASE, SPECIAL_TOKENS
from tiny_vlm import chat_template, save_with_tokenizer, scramble, text_settings, train_tokenizer
from tokenizers import Tokenizer

GLM_TOKENS = [
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
]
BEGIN_IMAGE_ID, END_IMAGE_ID, IMAGE_TOKEN_ID, BEGIN_VIDEO_ID, END_VIDEO_ID, VIDEO_TOKEN_ID = range(
    len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(GLM_TOKENS)
)
PATCH, MERGE, TEMPORAL = 8, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 16 * 16 * 60
# Glm4vVideoProcessor's fields, written here (saving one needs torchvision): its pixel bounds count
# every sampled frame (4 frames of 16x16 to 4 of 64x64), its values CLIP's as the image processor's.
VIDEO_PROCESSOR = {
    "video_processor_type": "Glm4vVideoProcessor",
    "size": {"shortest_edge": 4 * 16 * 16, "longest_edge": 4 * 64 * 64},
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "merge_size": MERGE,
    "fps": 2,
    "max_duration": 300,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
}
CHAT_TEMPLATE = chat_template(
    "<|begin_of_image|><|image|><|end_of_image|>", "<|begin_of_video|><|video|><|end_of_video|>"
)


def glm4v_tokenizer() -> Tokenizer:
    tokenizer = train_tokenizer(GLM_TOKENS)
    assert tokenizer.token_to_id("<|image|>") == IMAGE_TOKEN_ID
    return tokenizer


def write_tiny_glm4v(out_dir: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """moe: GLM-4.5V (Glm4vMoeForConditionalGeneration) instead, its text model GLM-4.5's (a dense
    first layer, then 8 experts in 4 groups, two shared experts, rotate-half over half of each head)."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = glm4v_tokenizer()
    text = text_settings(tokenizer.get_vocab_size())
    if moe:
        text |= GLM4_MOE  # tests/tiny_hf_models.py's GLM-4.5 shape, without q/k norms (4.5V has none)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "image_size": 4 * PATCH,
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "spatial_merge_size": MERGE,
        "out_hidden_size": BASE["hidden_size"],
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }
    kind = "Glm4vMoe" if moe else "Glm4v"
    config = getattr(transformers, kind + "Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        image_start_token_id=BEGIN_IMAGE_ID,
        image_end_token_id=END_IMAGE_ID,
        video_start_token_id=BEGIN_VIDEO_ID,
        video_end_token_id=END_VIDEO_ID,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, kind + "ForConditionalGeneration")(config).eval()
    scramble(model, seed, ("norm",))
    save_with_tokenizer(out, model, tokenizer, CHAT_TEMPLATE)
    transformers.Glm4vImageProcessorPil(
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    ).save_pretrained(out)
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR))
    return out


def glm4v_processor(model_dir: str | Path):
    """transformers' Glm4vProcessor over the model's image processor and tokenizer, with no video
    processor: its class check imports the video processors, which need torchvision (no build here)."""
    from transformers import Glm4vImageProcessorPil, Glm4vProcessor, PreTrainedTokenizerFast

    class ImagesOnlyGlm4vProcessor(Glm4vProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
    return ImagesOnlyGlm4vProcessor(
        image_processor=Glm4vImageProcessorPil.from_pretrained(model_dir), tokenizer=tokenizer
    )

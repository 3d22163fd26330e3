"""Rank 0's image inputs for a Gemma 3 model (Gemma3ForConditionalGeneration): as
tpserve/server/vision_input.py's for LLaVA, with Gemma3ImageProcessor's pixels (a resize to the
tower's size, no crop, then rescale and normalise) and Gemma3Processor's prompt: the template writes
`<start_of_image>` per image, which becomes "\\n\\n<start_of_image>", mm_tokens_per_image image
tokens and "<end_of_image>\\n\\n" in the prompt's text, tokenized whole (the newlines may merge
with the text beside them, so the prompt is decoded and tokenized again, as the processor
tokenizes its text). Each image's positions go in one pass (PromptImage.whole): its tokens see each
other. Pan and scan (the processor's crops) is refused by name at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from PIL import Image

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.gemma3_vision import load_gemma3_vision_tower
from tpserve.ranks.model_config import ModelConfig
from tpserve.server.images import Preprocessor, size_setting, value_settings
from tpserve.server.media_checks import is_video
from tpserve.server.processor_config import image_processor_settings
from tpserve.server.validation import invalid_argument
from tpserve.server.vision_input import PlacedPart, VisionInput, media_tokens

IMAGENET_STANDARD = (0.5, 0.5, 0.5)  # Gemma3ImageProcessor's mean and std


def gemma3_preprocessor(model_dir: str | Path, image_size: int) -> Preprocessor:
    """Gemma3ImageProcessor's settings as the shared Preprocessor (resize to size, no crop)."""
    raw, path = image_processor_settings(model_dir)
    if raw.get("do_pan_and_scan"):
        raise ModelFileError(path, "Gemma3: do_pan_and_scan (the processor's crops) is not implemented")
    defaults = {
        "resample": Image.Resampling.BILINEAR,
        "image_mean": IMAGENET_STANDARD,
        "image_std": IMAGENET_STANDARD,
    }
    size = size_setting(raw.get("size", image_size), "size", path)
    if size != (image_size, image_size):
        raise ModelFileError(path, f"size {size} is not the vision tower's image_size {image_size}")
    return Preprocessor(
        shortest_edge=None,
        resize_to=size if raw.get("do_resize", True) else None,
        crop=None,
        pad_to_square=False,
        **value_settings(defaults | raw),
    )


class Gemma3VisionInput(VisionInput):
    whole_images = True

    def __init__(self, tower, preprocessor, encode_text: Callable, decode_text: Callable):
        super().__init__(tower, preprocessor, decode_text([tower.config.boi_token_id]))
        self.encode_text, self.decode_text = encode_text, decode_text  # without BOS; with specials
        cfg = tower.config
        run = decode_text([cfg.image_token_id]) * cfg.tokens_per_image
        self.image_text = f"\n\n{self.image_token}{run}{decode_text([cfg.eoi_token_id])}\n\n"

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: ModelConfig,
        image_token: str,
        dtype,
        device="cpu",
        encode_text: Callable[[str], list[int]] | None = None,
        decode_text: Callable[[Sequence[int]], str] | None = None,
    ):
        """encode_text: the tokenizer's encode without BOS; decode_text: its decode keeping special
        tokens (the prompt is tokenized again with each image's text). image_token is not read: the
        template's is <start_of_image>."""
        if encode_text is None or decode_text is None:
            raise ValueError("a Gemma 3 model's image inputs need encode_text and decode_text")
        preprocessor = gemma3_preprocessor(model_dir, config.vision.image_size)
        tower = load_gemma3_vision_tower(model_dir, config.vision, dtype, device)
        return cls(tower, preprocessor, encode_text, decode_text)

    def expand(
        self,
        ids: Sequence[int],
        num_images: int,
        media: Sequence = (),
        wheres: Sequence[str] = (),
        limits=None,
    ) -> tuple[list[int], list[PlacedPart]]:
        """Template token ids with one <start_of_image> per image -> the prompt Gemma3Processor
        writes (each replaced by its image's text, tokenized whole), and each image's place (its
        first image token). `limits` is not read."""
        for part, where in zip(media, wheres):
            if is_video(part):
                raise invalid_argument(
                    f"{where}.media: this model reads no video inputs (send its frames as images)"
                )
        cfg = self.tower.config
        media_tokens(ids, {cfg.boi_token_id}, num_images, self.image_token)
        text = self.decode_text(ids)
        if list(self.encode_text(text)) != list(ids):
            raise invalid_argument(
                "the prompt's text does not tokenize back to its tokens (cannot place its images)"
            )
        out = list(self.encode_text(text.replace(self.image_token, self.image_text)))
        starts = [
            at
            for at, token in enumerate(out)
            if token == cfg.image_token_id and (at == 0 or out[at - 1] != token)
        ]
        if len(starts) != num_images or out.count(cfg.image_token_id) != num_images * self.tokens_per_image:
            raise invalid_argument(
                f"the prompt holds other image tokens than its {num_images} images' (the text may not "
                f"contain {self.decode_text([cfg.image_token_id])!r})"
            )
        return out, [PlacedPart(start) for start in starts]

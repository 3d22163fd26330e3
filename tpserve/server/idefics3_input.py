"""Rank 0's image inputs for an Idefics3 or SmolVLM model: as tpserve/server/vision_input.py's for
LLaVA, except that an image becomes tiles (tpserve/server/idefics3_images.py) and its one template
token becomes Idefics3Processor's text for them: per tile `<fake_token_around_image><row_i_col_j>`
then image_seq_len image tokens, a newline after each row, then `\\n<fake_token_around_image>
<global-img>`, the global image's image tokens and `<fake_token_around_image>` (an image of one tile:
that last part alone, without the newline). That text is tokenized by the model's own tokenizer; it
starts and ends with a special token, so its ids are those the processor's tokenizing of the whole
prompt gives. The layout, so the count, follows from the image's header alone.

Each tile's run of image tokens is a PromptImage of its own (its features, a key from the bytes'
hash and its index), as a Qwen3-VL video's temporal patches are. SmolVLM's video input (frames after
their times in text) is not implemented: a video part is refused by name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.siglip_vision import SiglipVisionTower, load_siglip_vision_tower
from tpserve.server.idefics3_images import Idefics3Preprocessor, TileLayout
from tpserve.server.images import decode_image, header_size
from tpserve.server.media_checks import is_video
from tpserve.server.processor_config import image_processor_settings, processor_field
from tpserve.server.validation import Limits, invalid_argument
from tpserve.server.vision_input import PlacedPart, apart, media_tokens

FAKE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<global-img>"
NO_VIDEO = "{where}.media: this model's video input is not implemented (send the video's frames as images)"


def image_prompt(layout: TileLayout, image_token: str, image_seq_len: int) -> str:
    """The text Idefics3Processor (and SmolVLMProcessor) writes for an image of this layout."""
    run = image_token * image_seq_len
    tiles = "".join(
        "".join(f"{FAKE_TOKEN}<row_{row + 1}_col_{col + 1}>{run}" for col in range(layout.cols)) + "\n"
        for row in range(layout.rows)
    )
    return tiles + ("\n" if layout.rows else "") + f"{FAKE_TOKEN}{GLOBAL_TOKEN}{run}{FAKE_TOKEN}"


class Idefics3VisionInput:
    def __init__(
        self,
        tower: SiglipVisionTower,
        preprocessor: Idefics3Preprocessor,
        image_token: str,
        encode_text: Callable[[str], list[int]],
    ):
        self.tower = tower
        self.preprocessor = preprocessor
        self.image_token = image_token
        self.image_token_id = tower.config.image_token_id
        self.image_seq_len = tower.config.image_seq_len
        self.encode_text = encode_text  # the tokenizer's, without BOS: the prompt text for each image
        self._lock = threading.Lock()  # one image through the tower at a time: bounded memory

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: ModelConfig,
        image_token: str,
        dtype,
        device="cpu",
        encode_text: Callable[[str], list[int]] | None = None,
    ):
        """encode_text: the tokenizer's encode without BOS (each image's prompt text is tokenized)."""
        if encode_text is None:
            raise ValueError("an Idefics3 model's image inputs need encode_text (their prompt is text)")
        vision = config.vision
        settings, path = image_processor_settings(model_dir)
        preprocessor = Idefics3Preprocessor.from_settings(settings)
        if preprocessor.tile_size != vision.image_size:
            raise ModelFileError(
                path,
                f"max_image_size.longest_edge {preprocessor.tile_size} is not the vision tower's image_size "
                f"{vision.image_size} (a tile would not give image_seq_len tokens)",
            )
        named, processor = processor_field(model_dir, "image_seq_len")
        if named is not None and named != vision.image_seq_len:
            raise ModelFileError(
                processor, f"image_seq_len {named} is not the tower's {vision.image_seq_len} tokens a tile"
            )
        tower = load_siglip_vision_tower(model_dir, vision, dtype, device)
        vision_input = cls(tower, preprocessor, image_token, encode_text)
        try:  # the tokenizer's reading of an image's text, once, before any request relies on it
            vision_input.check_splice(TileLayout(None, (0, 0), 1, 2))
        except ValueError as error:
            raise ModelFileError(Path(model_dir) / "tokenizer.json", str(error)) from None
        return vision_input

    def check_splice(self, layout: TileLayout, before: str = "User:", after: str = " what") -> None:
        """An image's ids spliced between text's are those of the text around its prompt tokenized
        whole (as the processor tokenizes): ValueError where the tokenizer reads them otherwise (an
        added token that strips the whitespace beside it, a merge across its edges)."""
        tokens, _ = self._tokens(layout)
        text = image_prompt(layout, self.image_token, self.image_seq_len)
        if self.encode_text(before + text + after) != self.encode_text(before) + tokens + self.encode_text(
            after
        ):
            raise ValueError(
                "the tokenizer reads an image's text otherwise beside other text (a stripping added token)"
            )

    def _tokens(self, layout: TileLayout) -> tuple[list[int], list[int]]:
        """An image's token ids and where each tile's image tokens start among them."""
        ids = self.encode_text(image_prompt(layout, self.image_token, self.image_seq_len))
        image = self.image_token_id
        starts = [at for at, token in enumerate(ids) if token == image and (at == 0 or ids[at - 1] != image)]
        if len(starts) != layout.num_tiles or ids.count(image) != layout.num_tiles * self.image_seq_len:
            raise ValueError(f"the tokenizer does not keep {self.image_token!r} whole in an image's prompt")
        return ids, starts

    def expand(
        self,
        ids: Sequence[int],
        num_images: int,
        media: Sequence = (),
        wheres: Sequence[str] = (),
        limits: Limits | None = None,
    ) -> tuple[list[int], list[PlacedPart]]:
        """Template token ids with one image token per image -> the prompt with each replaced by its
        tiles' text, and each image's tile runs in it. `limits` is not read (the same call as
        tpserve/server/qwen_vision_input.py's)."""
        wheres = list(wheres) or [f"image {number}" for number in range(num_images)]
        for part, where in zip(media, wheres):
            if is_video(part):
                raise invalid_argument(NO_VIDEO.format(where=where))
        found = media_tokens(ids, {self.image_token_id}, num_images, self.image_token, len(media))
        out, placed, at = [], [], 0
        for index, part, where in zip(found, media, wheres):
            width, height = header_size(part.data, where)
            tokens, starts = self._tokens(self.preprocessor.layout(height, width, where))
            out += ids[at:index]
            placed.append(PlacedPart(starts[0], None, tuple(starts)).shifted(len(out)))
            out += tokens
            at = index + 1
        return out + list(ids[at:]), placed

    def read(self, media: Sequence, placed: Sequence[PlacedPart], wheres: Sequence[str], limits: Limits):
        """The prompt's images (media parts in prompt order, at `placed`, as expand returned), each
        tile a PromptImage with its features."""
        images = []
        for part, place, where in zip(media, placed, wheres):
            tiles, layout = self.preprocessor.tiles(
                decode_image(part.data, where, limits.max_image_pixels), where
            )
            if layout.num_tiles != len(place.frame_offsets):  # the header said otherwise than the pixels
                raise invalid_argument(f"{where}.media.data is not a readable JPEG, PNG or WebP image")
            with self._lock:
                features = self.tower.features(tiles)  # [tiles * image_seq_len, text hidden], tile by tile
            images += apart(part.data, features, place.frame_offsets, self.image_seq_len)
        return tuple(images)

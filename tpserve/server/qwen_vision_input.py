"""Rank 0's image and video inputs for a Qwen2.5-VL, Qwen3-VL or GLM-4.1V (and GLM-4.5V) model: as
tpserve/server/vision_input.py's for LLaVA, except that a part's token count follows its size (smart
resize to the patch grid, then the 2x2 merge) and, for a video, its frames (two per temporal patch;
Qwen3-VL and GLM put each patch apart, with its time in text: tpserve/server/qwen3_videos.py,
tpserve/server/glm4v_videos.py).

The chat template writes one image pad (or video pad) token per part; each becomes the merged grid's
frames * rows * columns positions, which the part's header alone says (no pixel or frame is decoded
before the request is otherwise accepted: tpserve/server/videos.py counts a video's frames by demuxing
only, and expand hands its packets to read, which decodes them without demuxing the file again). Each
part carries its merged grid, frames and time step, from which the leader works out the chunks'
multimodal rotary positions (tpserve/ranks/mrope.py). The prompt-cache key is the bytes' hash.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tpserve.ranks.glm4v_vision import Glm4vVisionTower, load_glm4v_vision_tower
from tpserve.ranks.glm4v_vision_config import Glm4vVisionConfig
from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.qwen3_vision import Qwen3VisionTower, load_qwen3_vision_tower
from tpserve.ranks.qwen3_vision_config import Qwen3VisionConfig
from tpserve.ranks.qwen_vision import QwenVisionTower, load_qwen_vision_tower
from tpserve.server.glm4v_images import Glm4vPreprocessor
from tpserve.server.glm4v_videos import Glm4vVideoPreprocessor
from tpserve.server.images import decode_image, header_size
from tpserve.server.media_checks import is_video
from tpserve.server.qwen3_videos import Qwen3VideoPreprocessor
from tpserve.server.qwen_images import QwenPreprocessor
from tpserve.server.qwen_videos import QwenVideoPreprocessor, VideoPlan
from tpserve.server.requests import PromptImage
from tpserve.server.validation import Limits, invalid_argument
from tpserve.server.videos import DemuxedVideo, decode_frames, demux
from tpserve.server.vision_input import PlacedPart, apart, image_key, media_tokens

DEFAULT_LIMITS = Limits(context_size=0, vocab_size=0)  # the media limits' defaults, for callers naming none


class QwenVisionInput:
    def __init__(
        self,
        tower: QwenVisionTower | Qwen3VisionTower | Glm4vVisionTower,
        preprocessor: QwenPreprocessor,
        image_token: str,
        video: QwenVideoPreprocessor | None = None,
        timed_video: Qwen3VideoPreprocessor | None = None,
        encode_text: Callable[[str], list[int]] | None = None,
    ):
        self.tower = tower
        self.preprocessor = preprocessor
        self.video = video  # Qwen2.5-VL's: a video's patches in one run of pads
        self.timed_video = timed_video  # Qwen3-VL's: each temporal patch apart, after its time in text
        self.encode_text = encode_text  # the tokenizer's, for those times
        self.image_token_id = tower.config.image_token_id
        self.video_token_id = tower.config.video_token_id
        self.image_token = image_token  # its text, for the refusal when the counts disagree
        self._lock = threading.Lock()  # one image or video through the tower at a time: bounded memory

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
        """encode_text: the tokenizer's encode without BOS (Qwen3-VL writes each video frame's time)."""
        vision = config.vision
        if isinstance(vision, Glm4vVisionConfig):
            tower = load_glm4v_vision_tower(model_dir, vision, dtype, device)
            preprocessor = Glm4vPreprocessor.from_model_dir(model_dir)
            if vision.video_token_id is None:
                return cls(tower, preprocessor, image_token)
            if encode_text is None:
                raise ValueError(
                    "a GLM-4.1V model's video inputs need encode_text (each frame's time is text)"
                )
            timed_video = Glm4vVideoPreprocessor.from_model_dir(model_dir)
            return cls(tower, preprocessor, image_token, None, timed_video, encode_text)
        preprocessor = QwenPreprocessor.from_model_dir(model_dir)
        if isinstance(vision, Qwen3VisionConfig):
            tower = load_qwen3_vision_tower(model_dir, vision, dtype, device)
            timed = None not in (
                vision.video_token_id,
                vision.vision_start_token_id,
                vision.vision_end_token_id,
            )
            if timed and encode_text is None:
                raise ValueError(
                    "a Qwen3-VL model's video inputs need encode_text (each frame's time is text)"
                )
            timed_video = Qwen3VideoPreprocessor.from_model_dir(model_dir) if timed else None
            return cls(tower, preprocessor, image_token, None, timed_video, encode_text)
        tower = load_qwen_vision_tower(model_dir, vision, dtype, device)
        video = QwenVideoPreprocessor.from_model_dir(model_dir) if vision.video_token_id is not None else None
        return cls(tower, preprocessor, image_token, video)

    def merged_grid(self, data: bytes, where: str) -> tuple[int, int]:
        """(rows, columns) of an image's merged grid, from its header (the size) only."""
        width, height = header_size(data, where)
        height, width = self.preprocessor.resized_size(height, width)
        factor = self.preprocessor.patch_size * self.preprocessor.merge_size
        return height // factor, width // factor

    def video_plan(self, data: bytes, where: str, limits: Limits) -> tuple[DemuxedVideo, VideoPlan]:
        """A video's packets, and which frames it reads and their grid, from a demux pass alone."""
        if self.video is None:
            raise invalid_argument(
                f"{where}.media: this model reads no video inputs (its config names no video token)"
            )
        video = demux(data, where, limits)
        return video, self.video.plan(video.header, where)

    def expand(
        self,
        ids: Sequence[int],
        num_images: int,
        media: Sequence = (),
        wheres: Sequence[str] = (),
        limits: Limits = DEFAULT_LIMITS,
    ) -> tuple[list[int], list[PlacedPart]]:
        """Template token ids with one pad token per image or video -> the prompt with each widened
        to its merged grid's frames * rows * columns, and the parts' places in it (a video's with its
        packets, for read)."""
        pads = {self.image_token_id, self.video_token_id} - {None}
        found = media_tokens(ids, pads, num_images, self.image_token, len(media))
        out, placed, at = [], [], 0
        wheres = list(wheres) or [f"image {number}" for number in range(num_images)]
        for index, part, where in zip(found, media, wheres):
            video = None
            if is_video(part) and self.timed_video is not None:
                if ids[index] != self.video_token_id:
                    raise invalid_argument(
                        f"{where}: the chat template wrote the wrong pad token for this part"
                    )
                first, last, tokens, place = self._expand_timed_video(ids, index, part.data, where, limits)
                out += ids[at:first]
                placed.append(place.shifted(len(out)))
                out += tokens
                at = last
                continue
            if is_video(part):
                token = self.video_token_id
                video, plan = self.video_plan(part.data, where, limits)
                merge = self.preprocessor.merge_size
                count = plan.grid[0] * (plan.grid[1] // merge) * (plan.grid[2] // merge)
            else:
                token = self.image_token_id
                rows, cols = self.merged_grid(part.data, where)
                count = rows * cols
            if ids[index] != token:
                raise invalid_argument(f"{where}: the chat template wrote the wrong pad token for this part")
            out += ids[at:index]
            placed.append(PlacedPart(len(out), video))
            out += [token] * count
            at = index + 1
        return out + list(ids[at:]), placed

    def _expand_timed_video(self, ids: Sequence[int], index: int, data: bytes, where: str, limits: Limits):
        """A Qwen3-VL or GLM-4.1V video's pad at ids[index] -> the span of ids it replaces, its tokens
        (each temporal patch apart, with its time in text: the family's `expansion`) and its place
        (offsets from the span's start)."""
        video = demux(data, where, limits)
        plan = self.timed_video.plan(video.header, where)
        first, last, tokens, starts = self.timed_video.expansion(
            plan, self.tower.config, self.encode_text, ids, index
        )
        return first, last, tokens, PlacedPart(starts[0], video, tuple(starts))

    def _read_timed_video(self, data: bytes, place: PlacedPart, where: str) -> list[PromptImage]:
        """A Qwen3-VL video's temporal patches, each a PromptImage of one frame at its own offset."""
        plan = self.timed_video.plan(place.video.header, where)
        pre = self.timed_video.frames
        frames = decode_frames(
            place.video, where, plan.indices, lambda image: pre.pixels_at(image, *plan.size)
        )
        patches, grid = self.timed_video.patches(frames)
        with self._lock:
            features = self.tower.features(patches, grid)  # [t * rows * cols, ...], patch by patch
        merge = self.tower.config.spatial_merge_size
        merged = (grid[1] // merge, grid[2] // merge)
        return apart(data, features, place.frame_offsets, merged[0] * merged[1], merged)

    def read(self, media: Sequence, placed: Sequence[PlacedPart], wheres: Sequence[str], limits: Limits):
        """The prompt's images and videos (media parts in prompt order, at `placed`, as expand returned)
        with their features."""
        merge = self.tower.config.spatial_merge_size
        images = []
        for part, place, where in zip(media, placed, wheres):
            interval = 1.0
            if place.frame_offsets:
                images += self._read_timed_video(part.data, place, where)
                continue
            if is_video(part):
                plan = self.video.plan(place.video.header, where)
                frames = decode_frames(place.video, where, plan.indices, self.video.frames.pixels)
                patches, grid = self.video.patches(frames)
                # transformers multiplies tokens_per_second by second_per_grid_ts in float32
                interval = float(
                    np.float32(self.tower.config.tokens_per_second) * np.float32(plan.seconds_per_grid)
                )
            else:
                image = decode_image(part.data, where, limits.max_image_pixels)
                patches, grid = self.preprocessor.patches(image)
            with self._lock:
                features = self.tower.features(patches, grid)
            merged = (grid[1] // merge, grid[2] // merge)
            key = image_key(part.data)
            images.append(
                PromptImage(place.offset, features.shape[0], key, features, merged, grid[0], interval)
            )
        return tuple(images)

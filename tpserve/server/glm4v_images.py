"""A decoded image -> the flattened patches and grid a GLM-4.1V tower reads, as transformers'
Glm4vImageProcessor prepares them: Qwen-VL's (tpserve/server/qwen_images.py: the same patches, in
merge blocks, repeated over the temporal patch's two frames), with GLM's smart resize, whose pixel
bounds count both frames of the temporal patch, and which first scales an image smaller than one merge
block up to one (its sides truncated)."""

from __future__ import annotations

from tpserve.server.qwen_images import QwenPreprocessor, smart_resize

MIN_PIXELS, MAX_PIXELS = 112 * 112, 28 * 28 * 15000  # transformers' Glm4vImageProcessor defaults


class Glm4vPreprocessor(QwenPreprocessor):
    @classmethod
    def from_settings(cls, raw: dict, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
        return super().from_settings(raw, min_pixels, max_pixels)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.patch_size * self.merge_size
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        frames = self.temporal_patch_size  # an image is one temporal patch
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels, frames)

"""What this server runs and what requests are checked against: one frozen value both APIs read."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.kernels.sampling_params import SamplingParams


@dataclass(frozen=True)
class ServingInfo:
    """What Info (gRPC) and /v1/models (HTTP) report, and the limits requests are checked against
    (besides the tokenizer's vocabulary)."""

    model_name: str
    tp_size: int
    num_lanes: int
    context_size: int
    room: int
    vision: bool = False
    default_max_tokens: int | None = None  # None: the context the prompt leaves
    # An unset sampling field's value: the model's generation_config.json, else greedy, no filters.
    sampling_defaults: SamplingParams = SamplingParams()
    # An unset temperature over the OpenAI HTTP API (vLLM's default; gRPC's is sampling_defaults').
    openai_temperature: float = 1.0
    max_images: int = 4  # with --vision: image parts per request, bytes and pixels per image
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 4096 * 4096
    max_video_bytes: int = 10 << 20  # per video: bytes, duration, frames in the file, pixels per frame
    max_video_seconds: float = 120.0
    max_video_frames: int = 3600
    max_video_pixels: int = 1920 * 1080
    max_logprobs: int = 20  # likeliest tokens a request may ask per position; -1: the whole vocabulary
    model_aliases: tuple[str, ...] = ()  # more names the model answers to over HTTP

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

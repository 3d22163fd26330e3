"""Video bytes -> the frames a vision model reads, with PyAV (FFmpeg's demuxers and decoders).

MP4 and WebM only. Every limit is checked before any frame is decoded: the bytes
(tpserve/server/validation.py), then from the container's header the frame size and the duration, then a demux
pass that counts the video packets without decoding them (a header can lie about its frame count; the packets
cannot). Only then are frames decoded, and only the sampled ones are kept. Every failure is one RequestRefused
naming the part; the container is closed on every path, so nothing outlives the request.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import av
from PIL import Image

from tpserve.server.validation import Limits, RequestRefused, invalid_argument

# PyAV's names for the demuxers read here (FFmpeg groups MP4 with QuickTime, WebM with Matroska).
CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")
UNREADABLE = "is not a readable MP4 or WebM video"


@dataclass(frozen=True)
class VideoHeader:
    """What the container says, checked against the limits; num_frames is the packets counted."""

    num_frames: int
    fps: float
    width: int
    height: int


def read_header(data: bytes, where: str, limits: Limits) -> VideoHeader:
    """The video's frame count, rate and size, or a refusal naming the limit it passes."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return _header(container, where, limits)
    except RequestRefused:
        raise
    except Exception as error:  # an untrusted file: every way FFmpeg can fail is one refusal
        raise invalid_argument(f"{where}.media.data {UNREADABLE}") from error


def _header(container, where: str, limits: Limits) -> VideoHeader:
    if container.format.name not in CONTAINERS or not container.streams.video:
        raise invalid_argument(f"{where}.media.data {UNREADABLE}")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise invalid_argument(f"{where}.media.data {UNREADABLE}")
    if width * height > limits.max_video_pixels:
        raise invalid_argument(
            f"{where}.media is a video of {width}x{height} frames; the most per frame is "
            f"{limits.max_video_pixels} pixels (max_video_pixels)"
        )
    rate = stream.average_rate or stream.guessed_rate
    if not rate or rate <= 0:
        raise invalid_argument(f"{where}.media.data is a video without a frame rate")
    fps = float(rate)
    if container.duration is not None and container.duration / av.time_base > limits.max_video_seconds:
        raise _too_long(where, container.duration / av.time_base, limits)
    num_frames = 0
    for packet in container.demux(stream):
        if packet.size:  # the demuxer's last packet is an empty flush
            num_frames += 1
            if num_frames > limits.max_video_frames:
                raise invalid_argument(
                    f"{where}.media is a video of more than {limits.max_video_frames} frames (max_video_frames)"
                )
    if num_frames / fps > limits.max_video_seconds:
        raise _too_long(where, num_frames / fps, limits)
    if num_frames == 0:
        raise invalid_argument(f"{where}.media.data is a video without frames")
    return VideoHeader(num_frames, fps, width, height)


def _too_long(where: str, seconds: float, limits: Limits) -> RequestRefused:
    return invalid_argument(
        f"{where}.media is a video of {seconds:.1f} s; the most is {limits.max_video_seconds:g} s (max_video_seconds)"
    )


def decode_frames(
    data: bytes,
    where: str,
    header: VideoHeader,
    indices: Sequence[int],
    prepare: Callable[[Image.Image], object],
):
    """prepare(frame) for the frames at `indices` (in order, as RGB images), decoding no further
    than the last one; each other frame is dropped as soon as it is decoded."""
    wanted, out = set(indices), {}
    last = max(wanted)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "NONE"  # one decode thread per request: the submit threads bound it
            for index, frame in enumerate(container.decode(stream)):
                if index > last:
                    break
                if (frame.width, frame.height) != (header.width, header.height):
                    raise invalid_argument(f"{where}.media.data is a video whose frames change size")
                if index in wanted:
                    out[index] = prepare(frame.to_image())
    except RequestRefused:
        raise
    except Exception as error:
        raise invalid_argument(f"{where}.media.data {UNREADABLE}") from error
    if len(out) != len(wanted):
        raise invalid_argument(f"{where}.media.data is a video whose frames do not all decode")
    return [out[index] for index in indices]

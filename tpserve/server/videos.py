"""Video bytes -> the frames a vision model reads, with PyAV (FFmpeg's demuxers and decoders).

MP4 and WebM only. Every limit is checked before any frame is decoded: the bytes
(tpserve/server/validation.py), then from the container's header the frame size and the duration, then a demux
pass that counts the video packets without decoding them (a header can lie about its frame count; the packets
cannot). That pass keeps the packets (compressed, so no more than the bytes' limit) and the stream's
decoder, and the frames are decoded from them: the file is opened and demuxed once. Only the sampled frames
are kept. Every failure is one RequestRefused naming the part; the container is closed on every path, and
the packets and decoder belong to the request's DemuxedVideo, so nothing outlives the request.
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


class DemuxedVideo:
    """A video read as far as its packets: its checked header, its video packets in decode order and
    the stream's decoder (not yet opened). decode_frames reads it once; the decoder keeps its state."""

    def __init__(self, header: VideoHeader, decoder, packets: list):
        self.header = header
        self._decoder = decoder
        self._packets = packets

    def frames(self):
        """The decoded frames in presentation order; only once, since the packets go as they are read."""
        if self._packets is None:
            raise RuntimeError("a DemuxedVideo decodes once")
        packets, self._packets = self._packets, None
        for packet in packets:
            yield from self._decoder.decode(packet)
        yield from self._decoder.decode(None)  # the frames the decoder still holds (B-frames)


def demux(data: bytes, where: str, limits: Limits) -> DemuxedVideo:
    """The video's header and packets, or a refusal naming the limit it passes; no frame is decoded."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return _demux(container, where, limits)
    except RequestRefused:
        raise
    except Exception as error:  # an untrusted file: every way FFmpeg can fail is one refusal
        raise invalid_argument(f"{where}.media.data {UNREADABLE}") from error


def _demux(container, where: str, limits: Limits) -> DemuxedVideo:
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
    packets = []
    for packet in container.demux(stream):
        if packet.size:  # the demuxer's last packet is an empty flush
            packets.append(packet)
            if len(packets) > limits.max_video_frames:
                raise invalid_argument(
                    f"{where}.media is a video of more than {limits.max_video_frames} frames (max_video_frames)"
                )
    num_frames = len(packets)
    if num_frames / fps > limits.max_video_seconds:
        raise _too_long(where, num_frames / fps, limits)
    if num_frames == 0:
        raise invalid_argument(f"{where}.media.data is a video without frames")
    decoder = stream.codec_context  # outlives the container: it owns its FFmpeg context
    decoder.thread_type = "NONE"  # one decode thread per request: the submit threads bound it
    return DemuxedVideo(VideoHeader(num_frames, fps, width, height), decoder, packets)


def _too_long(where: str, seconds: float, limits: Limits) -> RequestRefused:
    return invalid_argument(
        f"{where}.media is a video of {seconds:.1f} s; the most is {limits.max_video_seconds:g} s (max_video_seconds)"
    )


def decode_frames(
    video: DemuxedVideo,
    where: str,
    indices: Sequence[int],
    prepare: Callable[[Image.Image], object],
):
    """prepare(frame) for the frames at `indices` (in order, as RGB images), decoding no further
    than the last one; each other frame is dropped as soon as it is decoded."""
    wanted, out = set(indices), {}
    last = max(wanted)
    size = (video.header.width, video.header.height)
    try:
        for index, frame in enumerate(video.frames()):
            if index > last:
                break
            if (frame.width, frame.height) != size:
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

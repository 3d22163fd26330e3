"""Checks of one image or video part before anything decodes it: the type, --vision, the bytes.

What a file holds (its size, duration, frames) is checked where it is read (server/images.py,
server/videos.py), still before its pixels are decoded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from tpserve.server.refusals import RequestRefused, invalid_argument

if TYPE_CHECKING:
    from tpserve.server.validation import Limits

MEDIA_TYPES = ("image/", "video/")
VISION_NEEDED = "image and video inputs need a server started with --vision"
IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp")
VIDEO_TYPES = ("video/mp4", "video/webm")


def check_media(media, where: str, limits: Limits) -> None:
    if not media.mime_type.startswith(MEDIA_TYPES):
        raise invalid_argument(f"{where}.media.mime_type {media.mime_type!r} is not an image or video type")
    if not limits.vision:
        raise RequestRefused(grpc.StatusCode.FAILED_PRECONDITION, VISION_NEEDED)
    if not media.data:
        raise invalid_argument(f"{where}.media.data is empty")
    if media.mime_type.startswith("video/"):
        _check_video(media, where, limits)
        return
    if media.mime_type == "image/*":  # what the HTTP API makes of an image_url that is no data: URL
        raise invalid_argument(
            f"{where}.media is a URL; this server fetches none: send the image's bytes (a data: URL)"
        )
    if media.mime_type not in IMAGE_TYPES:
        raise invalid_argument(
            f"{where}.media.mime_type {media.mime_type!r} is not one of {', '.join(IMAGE_TYPES)}"
        )
    if len(media.data) > limits.max_image_bytes:
        raise invalid_argument(
            f"{where}.media.data is {len(media.data)} bytes; the most per image is {limits.max_image_bytes}"
        )


def _check_video(media, where: str, limits: Limits) -> None:
    if media.mime_type == "video/*":  # what the HTTP API makes of a video_url that is no data: URL
        raise invalid_argument(
            f"{where}.media is a URL; this server fetches none: send the video's bytes (a data: URL)"
        )
    if media.mime_type not in VIDEO_TYPES:
        raise invalid_argument(
            f"{where}.media.mime_type {media.mime_type!r} is not one of {', '.join(VIDEO_TYPES)}"
        )
    if len(media.data) > limits.max_video_bytes:
        raise invalid_argument(
            f"{where}.media.data is {len(media.data)} bytes; the most per video is "
            f"{limits.max_video_bytes} (max_video_bytes)"
        )

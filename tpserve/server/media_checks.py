"""Checks of one image or video part before anything decodes it: the type, --vision, the bytes.

What a file holds (its size, duration, frames) is checked where it is read (tpserve/server/images.py,
tpserve/server/videos.py), still before its pixels are decoded.
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
# A url left unfetched: only a server whose allowed_media_domains names hosts fetches (before these
# checks: tpserve/server/media_fetch.py), and it fetches every image or video url.
URL_NOT_FETCHED = (
    "{where}.media.url: this server fetches none (allowed_media_domains names no host): send the "
    "{kind}'s bytes (gRPC: media.data; HTTP: a data: URL)"
)


def is_video(media) -> bool:
    """A media part (gRPC's Media, or the HTTP API's as it makes one) holding a video."""
    return media.mime_type.startswith("video/")


def check_media(media, where: str, limits: Limits) -> None:
    if not media.mime_type.startswith(MEDIA_TYPES):
        raise invalid_argument(f"{where}.media.mime_type {media.mime_type!r} is not an image or video type")
    if not limits.vision:
        raise RequestRefused(grpc.StatusCode.FAILED_PRECONDITION, VISION_NEEDED)
    if media.HasField("url"):
        kind = "video" if is_video(media) else "image"
        raise invalid_argument(URL_NOT_FETCHED.format(where=where, kind=kind))
    if not media.data:
        raise invalid_argument(f"{where}.media.data is empty")
    if is_video(media):
        _check_file(media, where, "video", VIDEO_TYPES, limits.max_video_bytes, " (max_video_bytes)")
    else:  # the image wording is frozen (tests/golden/errors/)
        _check_file(media, where, "image", IMAGE_TYPES, limits.max_image_bytes, "")


def _check_file(media, where: str, kind: str, types, max_bytes: int, named: str) -> None:
    """A part of `kind` ("image" or "video"): not a URL, one of `types`, at most max_bytes."""
    # Bytes of no one type: a URL sent as data (the HTTP API's `data:;base64,` too). Never fetched,
    # whatever allowed_media_domains says: a URL to fetch goes in media.url.
    if media.mime_type == f"{kind}/*":
        raise invalid_argument(
            f"{where}.media is a URL; this server fetches none: send the {kind}'s bytes (a data: URL)"
        )
    if media.mime_type not in types:
        raise invalid_argument(
            f"{where}.media.mime_type {media.mime_type!r} is not one of {', '.join(types)}"
        )
    if len(media.data) > max_bytes:
        raise invalid_argument(
            f"{where}.media.data is {len(media.data)} bytes; the most per {kind} is {max_bytes}{named}"
        )

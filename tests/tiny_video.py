"""Short videos the tests make with PyAV: blocks of random colour that change every frame (blocks,
so lossy codecs keep frames apart), as MP4 (H.264: the same bytes
for the same seed) or WebM (VP9; its muxer writes a random segment id)."""

from __future__ import annotations

import io

import av
import numpy as np

CODECS = {"mp4": "libx264", "webm": "libvpx-vp9"}
MIME_TYPES = {"mp4": "video/mp4", "webm": "video/webm"}


def block_video(seed: int, num_frames: int, size: tuple[int, int], fps: int = 4, fmt: str = "mp4") -> bytes:
    """num_frames frames of (width, height) `size` at `fps`, each a grid of 6x6-pixel blocks."""
    width, height = size
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(CODECS[fmt], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"threads": "1"}  # the same bytes every time: encoder threads race
        for _ in range(num_frames):
            blocks = rng.integers(0, 256, (-(-height // 6), -(-width // 6), 3), dtype=np.uint8)
            pixels = np.repeat(np.repeat(blocks, 6, axis=0), 6, axis=1)[:height, :width]
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()

"""How many bytes one request may take on either API, before any of it is read as a request.

The text allowance is the HTTP API's long-standing body limit: far more than a context of text
(longer prompts are refused by name before tokenizing, tpserve/server/validation.py check_prompt_size).
With vision, every image or video a request may carry (max_images parts of the larger of
max_image_bytes and max_video_bytes) fits beside it, so media the limits allow is never refused by
the transport first; over HTTP that is the media's base64, which takes 4 bytes for every 3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config's module imports much; these functions only read three fields
    from tpserve.server.config import ServeConfig

TEXT_BYTES = 4 << 20


def max_image_payload(config: ServeConfig) -> int:
    per_part = max(config.max_image_bytes, config.max_video_bytes)
    return config.max_images * per_part if config.vision else 0


def max_grpc_message_bytes(config: ServeConfig) -> int:
    """gRPC's receive limit: a message past it is refused RESOURCE_EXHAUSTED by grpc itself."""
    return TEXT_BYTES + max_image_payload(config)


def max_http_body_bytes(config: ServeConfig) -> int:
    """The HTTP body limit (413 past it): images arrive as base64 data: URLs."""
    return TEXT_BYTES + 4 * -(-max_image_payload(config) // 3)

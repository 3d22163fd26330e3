"""Both APIs (gRPC and, with a port, the OpenAI-compatible HTTP) over one engine client, built and
run as a pair: in rank 0's own process (LocalApis) or in the front process (tpserve/server/front_process.py).
"""

from __future__ import annotations

from tpserve.server.config import ServeConfig
from tpserve.server.engine_client import EngineClient
from tpserve.server.grpc_server import GrpcServer
from tpserve.server.http_api import OpenAIApi
from tpserve.server.http_connections import HttpLimits
from tpserve.server.http_server import HttpServer
from tpserve.server.idefics3_input import Idefics3VisionInput
from tpserve.server.media_fetch import MediaFetcher
from tpserve.server.media_hosts import allowed_hosts
from tpserve.server.metrics import ServingMetrics
from tpserve.server.qwen_vision_input import QwenVisionInput
from tpserve.server.request_size import max_grpc_message_bytes, max_http_body_bytes
from tpserve.server.serving_info import ServingInfo
from tpserve.server.submitter import Submitter
from tpserve.server.tls import tls_files
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.vision_input import VisionInput


class LocalApis:
    """The gRPC server and (when it has a port) the HTTP API, neither started yet."""

    def __init__(
        self,
        config: ServeConfig,
        engine: EngineClient,
        tokenizer: Tokenizer,
        info: ServingInfo,
        vision: VisionInput | QwenVisionInput | Idefics3VisionInput | None = None,
    ):
        # One Submitter for both APIs: the same checks and wording, and stopping refuses on both.
        metrics = ServingMetrics(engine.stats, engine.block_stats, info.model_name)
        submitter = Submitter(
            engine, tokenizer, info, metrics, vision, max_unread_tokens=config.max_unread_tokens
        )
        tls = tls_files(config.ssl_certfile, config.ssl_keyfile)
        fetcher = media_fetcher(config)  # one for both APIs: the same rules and limits
        self.server = GrpcServer(
            engine,
            tokenizer,
            info,
            port=config.port,
            host=config.host,
            metrics_port=config.metrics_port or None,
            queue_size=config.queue_size,
            submitter=submitter,
            api_key=config.api_key,
            metrics_need_key=config.metrics_need_key,
            max_message_bytes=max_grpc_message_bytes(config),
            handshake_timeout_s=config.grpc_handshake_timeout_s,
            keepalive_s=config.grpc_keepalive_s,
            tls=tls,
            media_fetcher=fetcher,
        )
        self.http = None
        if config.http_port:
            api = OpenAIApi(
                submitter,
                api_key=config.api_key,
                queue_size=config.queue_size,
                tool_call_parser=config.tool_call_parser,
                reasoning_parser=config.reasoning_parser,
                body_timeout_s=config.http_body_timeout_s,
                max_body_bytes=max_http_body_bytes(config),
                cors_origins=config.cors_origins,
                media_fetcher=fetcher,
            )
            limits = HttpLimits(
                header_timeout_s=config.http_header_timeout_s,
                body_timeout_s=config.http_body_timeout_s,
                keep_alive_s=config.http_keep_alive_s,
                max_connections=config.http_max_connections,
                write_stall_s=config.http_write_stall_s,
            )
            self.http = HttpServer(api.app(), host=config.host, port=config.http_port, limits=limits, tls=tls)

    def start(self) -> tuple[int | None, int]:
        """Both APIs' ports (HTTP's None when off). HTTP first: gRPC health turning SERVING then
        means both APIs answer."""
        http_port = self.http.start() if self.http is not None else None
        port = self.server.start()
        return http_port, port

    def begin_stopping(self) -> None:
        """New requests hear UNAVAILABLE "the server is stopping" on both APIs; live ones go on."""
        self.server.begin_stopping()

    def stop(self, grace_s: float) -> None:
        self.server.stop(grace_s=grace_s)
        if self.http is not None:
            self.http.stop(grace_s=grace_s)


def media_fetcher(config: ServeConfig) -> MediaFetcher | None:
    """Both APIs' fetcher of remote media URLs; None (every URL refused) without allowed hosts."""
    if not config.allowed_media_domains:
        return None
    return MediaFetcher(
        allowed_hosts(config.allowed_media_domains),
        config.media_fetch_timeout_s,
        config.max_image_bytes,
        config.max_video_bytes,
    )

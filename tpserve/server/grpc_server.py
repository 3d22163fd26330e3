"""Rank 0's gRPC server: the Serving service, grpc.health.v1 Health and server reflection.

Health reports SERVING while the lane host works and NOT_SERVING once it is broken or the server is
stopping; a watcher thread keeps it current, so Watch callers see the change too. With an API key,
every call but health needs `authorization: Bearer KEY` metadata (tpserve/server/api_key.py). The lane host's
own life (start, stop) belongs to whoever built it: stop this server first, then the host.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tpserve.ranks.errors import UserError
from tpserve.server.api_key import ApiKeyInterceptor
from tpserve.server.engine_client import EngineClient
from tpserve.server.grpc_calls import CallGuard
from tpserve.server.media_fetch import MediaFetcher
from tpserve.server.metrics import ServingMetrics
from tpserve.server.request_size import TEXT_BYTES
from tpserve.server.servicer import ServingServicer
from tpserve.server.serving_info import ServingInfo
from tpserve.server.submitter import QUEUE_FULL, Submitter
from tpserve.server.tls import TlsFiles
from tpserve.server.tokenizer import Tokenizer
from tpserve.v1 import serving_pb2, serving_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Serving"].full_name
EXTRA_WORKERS = 16  # threads beyond one per stream that can be live or queued: Tokenize, Info, health
SPARE_WORKERS = 8  # beyond every call that may run, for refusing the calls past them at once


class GrpcServer:
    def __init__(
        self,
        lane_host: EngineClient,
        tokenizer: Tokenizer,
        info: ServingInfo,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        metrics: ServingMetrics | None = None,
        metrics_port: int | None = None,
        queue_size: int = 64,
        health_poll_s: float = 0.2,
        submitter: Submitter | None = None,
        api_key: str = "",
        metrics_need_key: bool = False,
        max_message_bytes: int = TEXT_BYTES,
        handshake_timeout_s: float = 10.0,
        keepalive_s: float = 60.0,
        tls: TlsFiles | None = None,
        media_fetcher: MediaFetcher | None = None,
    ):
        """port 0 picks a free port (read it from `port` after start).

        metrics_port: serve Prometheus metrics there (on `host`) while this server runs; None
        serves none (0 picks a free port, read it from `metrics_port` after start). queue_size:
        the lane host's, which sizes the thread pool. submitter: the one the HTTP API shares (so
        stopping either refuses new requests on both); None builds one. api_key: "" serves anyone.
        max_message_bytes: the largest request message (tpserve/server/request_size.py); grpc refuses a
        larger one RESOURCE_EXHAUSTED, naming both sizes, before it reaches the servicer.
        handshake_timeout_s: a connection that has not sent its HTTP/2 preface and SETTINGS by
        then is closed (grpc's own default is 120 s). keepalive_s: a connection with calls open is
        pinged after that long quiet, and closed when the ping is unanswered as long again
        (grpc's default pings after 2 hours, so a vanished client's calls held their places).
        tls: serve TLS with these files (tpserve/server/tls.py); None: plain.
        media_fetcher: fetches Media urls of allowed_media_domains (tpserve/server/media_fetch.py);
        None refuses every url.
        """
        self._tls = tls
        self._lane_host = lane_host
        self._host = host
        self._address = f"{host}:{port}"
        self.metrics_port = metrics_port
        if submitter is None:
            if metrics is None:
                metrics = ServingMetrics(lane_host.stats, lane_host.block_stats)
            submitter = Submitter(lane_host, tokenizer, info, metrics)
        self.metrics = submitter.metrics
        self._submitter = submitter
        self._servicer = ServingServicer(submitter, media_fetcher=media_fetcher)
        self._api_key = api_key
        self._metrics_need_key = metrics_need_key  # the metrics port checks api_key too
        self._health = health.HealthServicer()
        self._health_poll_s = health_poll_s
        # Set here rather than left to grpc's defaults, which may change between releases: the
        # receive limit is what a request may carry, and a stalled handshake holds a socket.
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.server_handshake_timeout_ms", round(handshake_timeout_s * 1000)),
            ("grpc.keepalive_time_ms", round(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(keepalive_s * 1000)),
            ("grpc.http2.ping_timeout_ms", round(keepalive_s * 1000)),  # what grpc 1.85 goes by
            ("grpc.http2.max_pings_without_data", 0),  # grpc stops after 2 on a quiet Watch otherwise
            # grpc binds with SO_REUSEPORT by default: a second daemon on the same port would
            # start and be handed half the connections; it must fail to bind instead.
            ("grpc.so_reuseport", 0),
        ]
        # Each Generate holds a worker thread while its request waits or streams, so the pool must
        # fit every lane and every queue place; otherwise a queued request would wait inside gRPC
        # instead of getting a clear RESOURCE_EXHAUSTED from the lane host. Calls past that many
        # are refused by the guard (tpserve/server/grpc_calls.py) in the same words, on spare threads.
        self._max_running = info.num_lanes + queue_size + EXTRA_WORKERS
        self._server: grpc.Server | None = None
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> int:
        """Binds and starts serving; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("the gRPC server was already started")
        interceptors = [
            CallGuard(self._max_running, QUEUE_FULL)
        ]  # first: it wraps what the key check returns
        if self._api_key:
            interceptors.append(ApiKeyInterceptor(self._api_key))
        pool = futures.ThreadPoolExecutor(self._max_running + SPARE_WORKERS, thread_name_prefix="grpc")
        server = grpc.server(pool, interceptors=interceptors, options=self._options)
        serving_pb2_grpc.add_ServingServicer_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            if self._tls is None:
                port = server.add_insecure_port(self._address)
            else:
                port = server.add_secure_port(self._address, self._tls.grpc_credentials())
        except RuntimeError:  # grpc's own words name no port and no way out
            port = 0
        if port == 0:
            raise UserError(
                f"cannot bind the gRPC server to {self._address} (in use, or no such address); "
                "give port a free port"
            )
        self._set_health(self._current_health())
        server.start()
        self._server = server
        self.port = port
        self._watcher = threading.Thread(target=self._watch_health, name="grpc-health", daemon=True)
        self._watcher.start()
        log.info("gRPC serving %s on port %d%s", SERVICE_NAME, port, "" if self._tls is None else " (TLS)")
        if self.metrics_port is not None:
            key = self._api_key if self._metrics_need_key else None
            self.metrics_port = self.metrics.serve(self.metrics_port, self._host, key)
            log.info("Prometheus metrics on port %d", self.metrics_port)
        return port

    def begin_stopping(self) -> None:
        """Refuses new Generate calls with UNAVAILABLE and reports NOT_SERVING; live calls go on.

        A draining daemon calls this first, so requests arriving during its grace period get the
        servicer's precise refusal rather than a closed port.
        """
        self._submitter.begin_stopping()
        self._stop_watching.set()
        self._health.enter_graceful_shutdown()  # NOT_SERVING from now on, whatever else happens

    def stop(self, grace_s: float = 5.0) -> None:
        """Refuses new requests (UNAVAILABLE), gives live calls grace_s, then closes every call."""
        if self._server is None:
            return
        self.begin_stopping()
        done = self._server.stop(grace_s)
        if not done.wait(timeout=grace_s + 5.0):
            log.error("the gRPC server did not stop within %.1f s", grace_s + 5.0)
        if self._watcher is not None:
            self._watcher.join(timeout=self._health_poll_s + 5.0)
        self.metrics.stop()
        self._server = None

    def wait_for_termination(self, timeout_s: float | None = None) -> bool:
        """Blocks until the server stops; True once it has, False after timeout_s."""
        if self._server is None:
            return True
        timed_out = self._server.wait_for_termination(timeout_s)
        return not timed_out

    def _current_health(self) -> int:
        if self._lane_host.broken:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            self._health.set(service, status)

    def _watch_health(self) -> None:
        # Polling (not a callback) keeps the lane host free of any knowledge of gRPC; once broken,
        # the host stays broken, so the watcher can end there.
        while not self._stop_watching.wait(self._health_poll_s):
            if self._lane_host.broken:
                self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                log.error("the engine is broken: health is NOT_SERVING")
                return

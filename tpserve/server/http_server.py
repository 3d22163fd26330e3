"""Runs the HTTP API (tpserve/server/http_api.py) under uvicorn on its own thread, beside the gRPC server.

uvicorn is the ASGI server Starlette and FastAPI are usually served with; here it runs with its h11
protocol (pure Python, no compiled extras), guarded as tpserve/server/http_connections.py says (TCP_NODELAY,
head and keep-alive timeouts, a bound on connections), and without its own logging set-up, so its
lines carry the rank like every other. The socket is bound before the thread starts, so a taken port fails
start() at once, naming the address (a UserError: no traceback for a taken port).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from tpserve.ranks.errors import UserError
from tpserve.server.http_connections import HttpLimits, protocol_with
from tpserve.server.tls import TlsFiles

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


class HttpServer:
    def __init__(
        self,
        app,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: HttpLimits | None = None,
        tls: TlsFiles | None = None,
    ):
        """port 0 picks a free port (read it from `port` after start); limits: the defaults if None;
        tls: serve HTTPS with these files (tpserve/server/tls.py), None: plain HTTP."""
        self._tls = tls
        self._app = app
        self._limits = limits or HttpLimits()
        self._host = host
        self._requested_port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> int:
        """Binds, starts serving and returns the bound port."""
        if self._server is not None:
            raise RuntimeError("the HTTP server was already started")
        address = (self._host, self._requested_port)
        try:
            family = socket.getaddrinfo(self._host, self._requested_port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.create_server(address, family=family)
        except OSError as error:
            raise UserError(
                f"cannot bind the HTTP API to {self._host}:{self._requested_port} ({error.strerror}); "
                "give http_port a free port, or 0 to serve no HTTP API"
            ) from error
        config = uvicorn.Config(
            self._app,
            http=protocol_with(self._limits),
            timeout_keep_alive=self._limits.keep_alive_s,
            ws="none",
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,
            **(self._tls.uvicorn_options() if self._tls is not None else {}),
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive():
                sock.close()
                raise RuntimeError("the HTTP server ended while starting (see the log above)")
            if time.monotonic() > deadline:
                server.should_exit = True
                raise RuntimeError(f"the HTTP server did not start within {START_TIMEOUT_S:g} s")
            time.sleep(0.02)
        self._server, self._thread = server, thread
        self.port = sock.getsockname()[1]
        log.info(
            "HTTP API (OpenAI-compatible) on port %d%s", self.port, "" if self._tls is None else " (HTTPS)"
        )
        return self.port

    def stop(self, grace_s: float = 1.0) -> None:
        """Closes the port; open responses get grace_s, then the server ends."""
        if self._server is None:
            return
        self._server.config.timeout_graceful_shutdown = max(1, round(grace_s))
        self._server.should_exit = True
        self._thread.join(timeout=grace_s + 5.0)
        if self._thread.is_alive():
            log.error("the HTTP server did not stop within %.1f s", grace_s + 5.0)
        self._server = None

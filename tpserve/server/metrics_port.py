"""The metrics port: /metrics on a port of its own, optionally behind the API key.

prometheus_client's own server checks no key, so with `metrics_need_key` this one serves the page:
with a key set, a scrape needs `authorization: Bearer KEY` (tpserve/server/api_key.py's rule: exactly one
such header), else 401 with the fixed message.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tpserve.server.api_key import UNAUTHENTICATED, key_matches
from tpserve.server.http_errors import error_json

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus's text format


def serve_metrics(
    render: Callable[[], bytes], port: int, host: str, api_key: str
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve render() at /metrics on (host, port) on a thread of its own; the server and its thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                return self._reply(404, "application/json", json.dumps(error_json(404, "not found")).encode())
            if not key_matches(self.headers.get_all("authorization") or [], api_key):
                return self._reply(
                    401, "application/json", json.dumps(error_json(401, UNAUTHENTICATED)).encode()
                )
            self._reply(200, CONTENT_TYPE, render())

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # a scrape every few seconds is no news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread

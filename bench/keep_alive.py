"""A kept-alive HTTP client's requests against the real daemon, beside the same requests each on a
new connection, on an otherwise idle server.

Without TCP_NODELAY on the daemon's end, a kept-alive connection's reply waits for the client's
delayed ACK between uvicorn's two writes (its head, then its body): some 40 ms a request, where a
new connection (whose ACKs Linux sends at once while it is young) takes ~2 ms. So the ratio of the
two medians shows Nagle at work (well over 1) or not (about 1 or under: no handshake). Reported for
GET /v1/models and POST /tokenize: each kind's median over `--requests` requests (the first on the
kept-alive connection left out), the ratio, and whether the kept-alive median is under the issue's
10 ms; with the machine's load average, since the absolute times are the machine's.

    python -m bench.keep_alive [--requests 50] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model_dir, finish, median, print_table  # noqa: E402
from bench.front_gap import Daemon  # noqa: E402

ISSUE_BOUND_S = 0.010  # issue 25: a kept-alive client's second request under 10 ms on an idle server
NAGLE_RATIO = 2.0  # kept-alive over new connections past this: replies wait for delayed ACKs
REQUESTS = {
    "GET /v1/models": ("GET", "/v1/models", None),
    "POST /tokenize": ("POST", "/tokenize", json.dumps({"prompt": "hello there"}).encode()),
}


def timed(connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None) -> float:
    headers = {"content-type": "application/json"} if body is not None else {}
    started = time.perf_counter()
    connection.request(method, path, body=body, headers=headers)
    reply = connection.getresponse()
    reply.read()
    elapsed = time.perf_counter() - started
    if reply.status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {reply.status}")
    return elapsed


def measure(http_port: int, method: str, path: str, body: bytes | None, num_requests: int) -> dict:
    kept = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
    try:
        kept_s = [timed(kept, method, path, body) for _ in range(num_requests + 1)][1:]
    finally:
        kept.close()
    fresh_s = []
    for _ in range(num_requests):
        fresh = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        try:
            fresh_s.append(timed(fresh, method, path, body))
        finally:
            fresh.close()
    return {
        "kept_alive_median_ms": median(kept_s) * 1000,
        "kept_alive_max_ms": max(kept_s) * 1000,
        "new_connection_median_ms": median(fresh_s) * 1000,
        "ratio": median(kept_s) / median(fresh_s),
        "under_10_ms": median(kept_s) < ISSUE_BOUND_S,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--requests", type=int, default=50, help="requests of each kind and way")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")
    parser.add_argument("--log", default="/tmp/keep_alive.log", help="where the daemon's log goes")
    args = parser.parse_args(argv)
    daemon = Daemon(args.model or default_model_dir(), 2048, False, Path(args.log))
    try:
        daemon.wait_serving()
        load_before = os.getloadavg()[0]
        rows = {name: measure(daemon.http_port, *spec, args.requests) for name, spec in REQUESTS.items()}
        load_after = os.getloadavg()[0]
    finally:
        daemon.stop()
    print_table(
        "kept-alive HTTP requests against new connections",
        [
            "request",
            "kept-alive median ms",
            "kept-alive max ms",
            "new connection median ms",
            "ratio",
            "< 10 ms",
        ],
        [
            [name, f"{r['kept_alive_median_ms']:.2f}", f"{r['kept_alive_max_ms']:.2f}"]
            + [
                f"{r['new_connection_median_ms']:.2f}",
                f"{r['ratio']:.2f}",
                "yes" if r["under_10_ms"] else "no",
            ]
            for name, r in rows.items()
        ],
    )
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    report = {"requests": rows, "load_average_1min": [load_before, load_after]}
    nagle = [name for name, r in rows.items() if r["ratio"] > NAGLE_RATIO]
    failure = f"kept-alive requests slower than new connections ({', '.join(nagle)})" if nagle else None
    return finish(report, args.json, failure)


if __name__ == "__main__":
    sys.exit(main())

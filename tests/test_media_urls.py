"""Remote media URLs (allowed_media_domains, tpserve/server/media_fetch.py) against real HTTPS servers on
loopback with a trustme certificate for `localhost`: the bytes of an allowed host's image, a body
over the limit stopped while streaming, a slow server cut at the time limit, a redirect refused, a
certificate for another name refused, one resolution per fetch; and, under the public-only rule
every daemon runs, `localhost` refused as a loopback address before any connection. Only these unit
tests relax that rule, by handing the fetcher a policy that lets loopback through. Nothing here
reaches beyond loopback: other names are under .invalid and are never resolved.
"""

from __future__ import annotations

import http.server
import ipaddress
import socket
import ssl
import threading
import time
from contextlib import closing

import anyio
import pytest
import trustme
from tiny_llava import block_image

from tpserve.server.config import ConfigError, load_config
from tpserve.server.media_fetch import MediaFetcher
from tpserve.server.media_hosts import public_address_problem
from tpserve.server.refusals import RequestRefused
from tpserve.v1 import serving_pb2

IMAGE = block_image(7)
MAX_BYTES = 64 * 1024
WHERE = "messages[0].parts[0].media"


def loopback_too(address) -> str | None:
    """The public-only rule, but for loopback addresses: what lets these tests reach their servers."""
    return None if address.is_loopback else public_address_problem(address)


class Handler(http.server.BaseHTTPRequestHandler):
    """Each path one behaviour of a media host."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        self.server.hosts.append(self.headers.get("Host"))
        if self.path == "/cat.png":
            self._head(200, {"Content-Type": "image/png; charset=binary", "Content-Length": str(len(IMAGE))})
            self.wfile.write(IMAGE)
        elif self.path == "/endless":  # no length: the body goes on until the client hangs up
            self._head(200, {"Content-Type": "image/png", "Connection": "close"})
            self._write_until_closed(bytes(16 * 1024), pause_s=0.0)
        elif self.path == "/declared":  # says its length is too large, then sends nothing
            self._head(200, {"Content-Type": "image/png", "Content-Length": str(10 * MAX_BYTES)})
            time.sleep(5)
        elif self.path == "/slow":  # a byte every 50 ms, for longer than any test waits
            self._head(200, {"Content-Type": "image/png", "Connection": "close"})
            self._write_until_closed(b"x", pause_s=0.05)
        elif self.path == "/redirect":
            self._head(302, {"Location": "https://elsewhere.invalid/cat.png", "Content-Length": "0"})
        else:
            self._head(404, {"Content-Length": "0"})

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _write_until_closed(self, piece: bytes, pause_s: float) -> None:
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline:
                self.wfile.write(piece)
                self.wfile.flush()
                time.sleep(pause_s)
        except OSError:
            return


def https_server(authority: trustme.CA, name: str) -> http.server.ThreadingHTTPServer:
    """A loopback HTTPS server whose certificate names `name`, serving on its own thread."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.paths, server.hosts = [], []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert(name).configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def authority():
    return trustme.CA()


@pytest.fixture(scope="module")
def server(authority):
    served = https_server(authority, "localhost")
    yield served
    served.shutdown()
    served.server_close()


def fetcher(authority, *, timeout_s: float = 10.0, address_problem=loopback_too) -> MediaFetcher:
    context = ssl.create_default_context()
    authority.configure_trust(context)
    return MediaFetcher(
        frozenset({"localhost"}),
        timeout_s,
        MAX_BYTES,
        MAX_BYTES,
        ssl_context=context,
        address_problem=address_problem,
    )


def url(server, path: str) -> str:
    return f"https://localhost:{server.server_address[1]}{path}"


def fetch(fetcher: MediaFetcher, address: str, kind: str = "image") -> serving_pb2.Media:
    return anyio.run(fetcher.fetch, address, kind, WHERE)


def refusal(fetcher: MediaFetcher, address: str, kind: str = "image") -> str:
    with pytest.raises(RequestRefused) as refused:
        fetch(fetcher, address, kind)
    assert refused.value.code.name == "INVALID_ARGUMENT"
    return refused.value.message


def test_an_allowed_host_gives_its_bytes_and_type(authority, server):
    media = fetch(fetcher(authority), url(server, "/cat.png"))
    assert (media.mime_type, media.data) == ("image/png", IMAGE)


def test_a_body_past_the_limit_stops_being_read_and_names_the_limit(authority, server):
    started = time.monotonic()
    message = refusal(fetcher(authority, timeout_s=30.0), url(server, "/endless"))
    assert (
        message
        == f"{WHERE}: the image from localhost is over {MAX_BYTES} bytes, the most per image (max_image_bytes)"
    )
    assert time.monotonic() - started < 10  # stopped at the limit, not read on to the time limit
    video = refusal(fetcher(authority), url(server, "/endless"), kind="video")
    assert video.endswith("the most per video (max_video_bytes)")


def test_a_declared_length_over_the_limit_is_refused_before_the_body(authority, server):
    started = time.monotonic()
    message = refusal(fetcher(authority, timeout_s=30.0), url(server, "/declared"))
    assert "is over 65536 bytes" in message
    assert time.monotonic() - started < 4  # the server sends nothing for 5 s: no body was waited for


def test_a_slow_server_fails_at_the_time_limit(authority, server):
    started = time.monotonic()
    message = refusal(fetcher(authority, timeout_s=0.5), url(server, "/slow"))
    assert message == f"{WHERE}: the image from localhost did not arrive within media_fetch_timeout_s (0.5 s)"
    assert time.monotonic() - started < 3


def test_a_redirect_to_another_host_is_refused_not_followed(authority, server):
    message = refusal(fetcher(authority), url(server, "/redirect"))
    assert message == (
        f"{WHERE}: localhost answered 302, a redirect (to elsewhere.invalid); "
        "media URLs are fetched without following redirects"
    )
    assert server.paths[-1] == "/redirect"


def test_an_error_status_is_refused(authority, server):
    assert refusal(fetcher(authority), url(server, "/missing")) == f"{WHERE}: localhost answered HTTP 404"


def test_a_certificate_for_another_name_is_refused(authority):
    other = https_server(authority, "other.invalid")
    try:
        message = refusal(fetcher(authority), f"https://localhost:{other.server_address[1]}/cat.png")
    finally:
        other.shutdown()
        other.server_close()
    assert message.startswith(f"{WHERE}: could not connect to localhost") and "certificate" in message.lower()


def test_the_host_is_resolved_once_and_the_checked_address_is_the_one_reached(authority, server, monkeypatch):
    looked_up = []
    resolve = socket.getaddrinfo

    def counted(host, *args, **kwargs):
        looked_up.append(host.decode() if isinstance(host, bytes) else host)
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counted)
    assert fetch(fetcher(authority), url(server, "/cat.png")).data == IMAGE
    assert looked_up.count("localhost") == 1 and set(looked_up) <= {"localhost", "127.0.0.1", "::1"}
    assert server.hosts[-1] == f"localhost:{server.server_address[1]}"  # the URL's host, not the address


def test_under_the_public_only_rule_localhost_is_refused_as_loopback_before_any_connection(authority):
    with closing(socket.socket()) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        message = refusal(
            fetcher(authority, address_problem=public_address_problem), f"https://localhost:{port}/cat.png"
        )
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing waits to be accepted: no connection was made
            listener.accept()
    assert message == (
        f"{WHERE}: the host 'localhost' resolves to 127.0.0.1, a loopback address; "
        "media is fetched from public addresses only"
    )


def test_plain_http_other_schemes_and_hosts_not_listed_are_refused_by_name(authority, monkeypatch):
    def no_lookup(*args, **kwargs):
        raise AssertionError("a refused URL's host was looked up")

    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    strict = fetcher(authority, address_problem=public_address_problem)
    only = "not fetched, only https:// ones"
    assert refusal(strict, "http://localhost/cat.png") == f"{WHERE}: http:// URLs are {only}"
    assert refusal(strict, "file:///etc/passwd") == f"{WHERE}: file:// URLs are {only}"
    assert refusal(strict, "cat.png") == f"{WHERE}: a URL without a scheme is {only}"
    assert (
        refusal(strict, "data:image/png,raw")
        == f"{WHERE} is a data: URL without base64 (data:TYPE;base64,...)"
    )
    assert refusal(strict, "https://cats.invalid/cat.png") == (
        f"{WHERE}: the host 'cats.invalid' is not in allowed_media_domains (localhost)"
    )
    # Exact names only, as vLLM's: neither a subdomain nor a longer name that ends the same.
    assert "is not in allowed_media_domains" in refusal(strict, "https://a.localhost/cat.png")
    assert "is not in allowed_media_domains" in refusal(strict, "https://notlocalhost/cat.png")


@pytest.mark.parametrize(
    "address, kind",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.1", "private"),
        ("169.254.169.254", "link-local"),  # a cloud's metadata service
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped: judged by the IPv4 address
        ("::ffff:10.0.0.1", "private"),
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("100.64.0.1", "not a global"),  # carrier-grade NAT
    ],
)
def test_only_public_unicast_addresses_pass(address, kind):
    assert kind in public_address_problem(ipaddress.ip_address(address))


def test_public_addresses_pass():
    for address in ("8.8.8.8", "2001:4860:4860::8888"):
        assert public_address_problem(ipaddress.ip_address(address)) is None


def test_fill_replaces_each_url_part_once_for_every_choice(authority, server):
    requests = []
    for _ in range(3):  # n = 3: the same messages in each choice
        request = serving_pb2.GenerateRequest()
        message = request.messages.add(role="user")
        message.parts.add(media=serving_pb2.Media(mime_type="image/*", url=url(server, "/cat.png")))
        message.parts.add(text="what")
        requests.append(request)
    before = len(server.paths)
    anyio.run(fetcher(authority).fill, requests)
    assert len(server.paths) == before + 1
    for request in requests:
        assert request.messages[0].parts[0].media == serving_pb2.Media(mime_type="image/png", data=IMAGE)
        assert request.messages[0].parts[1].text == "what"


def test_the_domain_list_is_off_by_default_and_a_bad_entry_is_refused_at_start_up_by_name():
    assert load_config(None, {}, environ={}).allowed_media_domains == ()
    config = load_config(
        None, {"vision": "true", "allowed_media_domains": "img.example,CDN.example"}, environ={}
    )
    assert config.allowed_media_domains == ("img.example", "CDN.example")
    assert config.media_fetch_timeout_s == 10.0
    cases = [
        (
            "https://img.example/cats",
            "'https://img.example/cats' is a URL; give the host name alone (such as 'img.example')",
        ),
        ("*.example.com", "'*.example.com' is a wildcard; hosts match exactly"),
        ("img.example:443", "'img.example:443' holds a port or is an IPv6 address"),
        ("under_score.example", "'under_score.example' is not a host name"),
    ]
    for entry, wording in cases:
        with pytest.raises(ConfigError) as refused:
            load_config(None, {"vision": "true", "allowed_media_domains": entry}, environ={})
        assert str(refused.value).startswith(f"allowed_media_domains: {wording}")
    with pytest.raises(ConfigError, match="media URLs are fetched only with vision on"):
        load_config(None, {"allowed_media_domains": "img.example"}, environ={})
    with pytest.raises(ConfigError, match="media_fetch_timeout_s: must be positive"):
        load_config(None, {"media_fetch_timeout_s": "0"}, environ={})

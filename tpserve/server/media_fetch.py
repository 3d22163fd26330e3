"""Remote image and video URLs, fetched for both APIs when the operator allows their hosts
(allowed_media_domains): https only, the host named exactly, every address it resolves to public.

The host is resolved once, every address checked before any connection, and the connection made
to a checked address (the URL's host goes in the SNI, the certificate check and the Host header),
so a second resolution cannot point it elsewhere (DNS rebinding). Redirects are never followed:
a 3xx answer fails the request. The body is read in pieces and reading stops past the part's byte
limit (max_image_bytes, max_video_bytes); the whole fetch (resolution, connection, body) has
media_fetch_timeout_s. Proxies from the environment are ignored, so the checked address is the
one reached. Any failure refuses that request alone, INVALID_ARGUMENT (HTTP 400), naming why.

A URL is a Media's `url` (gRPC's field; the HTTP API puts an image_url or video_url that is no
data: URL there). It is fetched before the request is queued, never on the engine's thread: in the
HTTP handler's async context, or on the gRPC call's own thread (fill_blocking).
"""

from __future__ import annotations

import ipaddress
import socket
import ssl

import anyio
import httpx

from tpserve.server.media_hosts import AddressPolicy, IPAddress, public_address_problem
from tpserve.server.refusals import invalid_argument
from tpserve.v1 import serving_pb2

_KINDS = ("image", "video")  # a url part's mime_type says which (the HTTP API's: image/*, video/*)


class MediaFetcher:
    def __init__(
        self,
        hosts: frozenset[str],
        timeout_s: float,
        max_image_bytes: int,
        max_video_bytes: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        address_problem: AddressPolicy = public_address_problem,
    ):
        """hosts: allowed_media_domains, lower case. ssl_context: the CAs trusted (httpx's
        default when None). address_problem: why an address may not be reached; only a unit test
        of this class passes another than the public-only rule."""
        self._hosts = hosts
        self._timeout_s = timeout_s
        self._max_bytes = {"image": max_image_bytes, "video": max_video_bytes}
        self._ssl_context = ssl_context if ssl_context is not None else httpx.create_ssl_context()
        self._address_problem = address_problem

    async def fill(self, requests) -> None:
        """Every URL part of these GenerateRequests (or TokenizeRequests) replaced by its fetched
        bytes and type, in place (each URL fetched once: a request's choices repeat its messages).
        A url whose mime_type is no image or video type is left for the media checks to refuse."""
        fetched: dict[tuple[str, str], serving_pb2.Media] = {}
        for request in requests:
            for index, message in enumerate(request.messages):
                for part_index, part in enumerate(message.parts):
                    if not part.HasField("media") or not part.media.HasField("url"):
                        continue
                    kind = part.media.mime_type.partition("/")[0]
                    if kind not in _KINDS:
                        continue
                    url = part.media.url
                    if (url, kind) not in fetched:
                        where = f"messages[{index}].parts[{part_index}].media"
                        fetched[url, kind] = await self.fetch(url, kind, where)
                    part.media.CopyFrom(fetched[url, kind])

    def fill_blocking(self, requests) -> None:
        """fill, from a thread that runs no event loop (a gRPC call's): in a loop of its own,
        returning once every URL is fetched or one is refused (within media_fetch_timeout_s each)."""
        anyio.run(self.fill, requests)

    async def fetch(self, url: str, kind: str, where: str) -> serving_pb2.Media:
        """One URL's bytes and Content-Type; `kind` "image" or "video" (its byte limit); `where`
        names the part in a refusal."""
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as error:
            raise invalid_argument(f"{where} is not a valid URL ({error})") from None
        if parsed.scheme == "data":
            raise invalid_argument(f"{where} is a data: URL without base64 (data:TYPE;base64,...)")
        if parsed.scheme != "https":
            shown = f"{parsed.scheme}:// URLs are" if parsed.scheme else "a URL without a scheme is"
            raise invalid_argument(f"{where}: {shown} not fetched, only https:// ones")
        host = parsed.raw_host.decode("ascii")  # an international name in its xn-- form
        if host not in self._hosts:
            raise invalid_argument(
                f"{where}: the host {host!r} is not in allowed_media_domains ({', '.join(sorted(self._hosts))})"
            )
        try:
            with anyio.fail_after(self._timeout_s):
                addresses = await self._checked_addresses(host, parsed.port or 443, where)
                return await self._read(parsed, host, addresses, kind, where)
        except (TimeoutError, httpx.TimeoutException):
            raise invalid_argument(
                f"{where}: the {kind} from {host} did not arrive within media_fetch_timeout_s "
                f"({self._timeout_s:g} s)"
            ) from None

    async def _checked_addresses(self, host: str, port: int, where: str) -> list[IPAddress]:
        """The host's addresses, resolved once; any one that is not allowed refuses the fetch."""
        try:
            infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise invalid_argument(f"{where}: the host {host!r} did not resolve ({error})") from None
        addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
        for address in addresses:
            problem = self._address_problem(address)
            if problem is not None:
                raise invalid_argument(
                    f"{where}: the host {host!r} resolves to {address}, {problem}; "
                    "media is fetched from public addresses only"
                )
        return addresses

    async def _read(
        self, url: httpx.URL, host: str, addresses: list[IPAddress], kind: str, where: str
    ) -> serving_pb2.Media:
        """GET from the first checked address that connects; the body read up to the limit."""
        limits = httpx.Limits(max_keepalive_connections=0)  # a connection never serves another host
        async with httpx.AsyncClient(
            verify=self._ssl_context, trust_env=False, follow_redirects=False, limits=limits, timeout=None
        ) as client:
            failures = []
            for address in addresses:
                try:
                    async with client.stream(
                        "GET",
                        url.copy_with(host=str(address)),
                        headers={"Host": url.netloc.decode("ascii"), "Accept-Encoding": "identity"},
                        extensions={"sni_hostname": host},
                    ) as response:
                        return await self._body(response, host, kind, where)
                except httpx.ConnectError as error:
                    failures.append(f"{address}: {error}")
                except httpx.TransportError as error:
                    raise invalid_argument(f"{where}: fetching from {host} failed ({error})") from None
            raise invalid_argument(f"{where}: could not connect to {host} ({'; '.join(failures)})")

    async def _body(self, response: httpx.Response, host: str, kind: str, where: str) -> serving_pb2.Media:
        if response.is_redirect:
            try:
                target = httpx.URL(response.headers.get("location", "")).host or host
            except httpx.InvalidURL:
                target = "a malformed Location"
            raise invalid_argument(
                f"{where}: {host} answered {response.status_code}, a redirect (to {target}); "
                "media URLs are fetched without following redirects"
            )
        if response.status_code != 200:
            raise invalid_argument(f"{where}: {host} answered HTTP {response.status_code}")
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            raise invalid_argument(f"{where}: {host} sent the {kind} with Content-Encoding {encoding}")
        max_bytes = self._max_bytes[kind]
        over = invalid_argument(
            f"{where}: the {kind} from {host} is over {max_bytes} bytes, the most per {kind} "
            f"(max_{kind}_bytes)"
        )
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise over  # said before a byte of the body is read
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > max_bytes:
                raise over  # reading stops here; the connection closes unread
        mime_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if mime_type.endswith("/*"):
            mime_type = ""  # a wildcard is no file's type (and marks a URL in media_checks)
        return serving_pb2.Media(mime_type=mime_type, data=bytes(body))

"""TLS on both APIs: one certificate chain and its private key, PEM files, as vLLM's --ssl-certfile
and --ssl-keyfile. gRPC serves them through its SSL server credentials and HTTP through uvicorn's
ssl options; the metrics port stays plain (it is scraped from beside the host, and has its key).

The files are checked when the config is read, before any rank loads a model: a missing file, a
key that is not the certificate's, or one option without the other is a start-up error naming it.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    certfile: str  # the server's certificate, then any intermediates
    keyfile: str

    def grpc_credentials(self) -> grpc.ServerCredentials:
        chain = Path(self.certfile).read_bytes()
        return grpc.ssl_server_credentials([(Path(self.keyfile).read_bytes(), chain)])

    def uvicorn_options(self) -> dict[str, str]:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}


def tls_files(certfile: str, keyfile: str) -> TlsFiles | None:
    """The config's TLS files; None: both APIs plain."""
    return TlsFiles(certfile, keyfile) if certfile else None


def tls_problem(certfile: str, keyfile: str) -> str | None:
    """Why these files cannot serve TLS, or None (also when neither is given)."""
    if not certfile and not keyfile:
        return None
    if not certfile or not keyfile:
        return "ssl_certfile and ssl_keyfile go together: give both, or neither to serve plain"
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except OSError as error:
        if isinstance(error, ssl.SSLError):
            return (
                f"the certificate {certfile} and key {keyfile} do not load together ({error.reason or error})"
            )
        return f"cannot read {error.filename or certfile}: {error.strerror}"
    return None

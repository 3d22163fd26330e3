"""A refused request: the gRPC status code and the message the client sees (tpserve/server/validation.py owns
the wording of each)."""

from __future__ import annotations

import grpc


class RequestRefused(Exception):
    """A request this server will not run: the gRPC status code and the message the client sees."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> RequestRefused:
    """A refusal with INVALID_ARGUMENT (a 400 over HTTP)."""
    return RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, message)

"""The refusal every OpenAI body reader raises: a bad field, named (the error's `param`)."""

from __future__ import annotations

import grpc

from tpserve.server.validation import RequestRefused


class FieldRefused(RequestRefused):
    """A bad field of an OpenAI body: INVALID_ARGUMENT, and the field's name (the error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.param = param

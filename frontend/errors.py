"""RequestError: how any part of the frontend refuses a request (a gRPC status and a message naming the field)."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request the server refuses: a gRPC status code and a message that names the field."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing_metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)

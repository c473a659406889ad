"""Errors the router raises before or instead of streaming; each server maps them to its codes.

| error | gRPC | HTTP |
|---|---|---|
| `InvalidRequestError` | INVALID_ARGUMENT | 400 |
| `ModelNotFoundError` | NOT_FOUND | 404 |
| `QueueFullError` | RESOURCE_EXHAUSTED | 429 |
| `QueueTimeoutError` | DEADLINE_EXCEEDED | 504 |
| `DeadlineExceededError` | DEADLINE_EXCEEDED | 504 |
| `RequestNotFoundError` | NOT_FOUND | 404 |
| `UnavailableError` | UNAVAILABLE | 503 |
"""

from __future__ import annotations

import re


class RouterError(Exception):
    """Base class; `param` names the request field at fault, when there is one.

    `code` is the gRPC status name in lower case (also the `code` label of the rejection
    metric).
    """

    code = "unknown"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequestError(RouterError):
    """Bad input; the message starts with the field it is about (`temperature must be ...`)."""

    code = "invalid_argument"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param or _leading_field(message))


class ModelNotFoundError(RouterError):
    """The request names a model this router does not serve."""

    code = "not_found"


class QueueFullError(RouterError):
    """The admission queue is full; try again later."""

    code = "resource_exhausted"


class QueueTimeoutError(RouterError):
    """The request's deadline passed while it waited for admission."""

    code = "deadline_exceeded"


class DeadlineExceededError(RouterError):
    """The request's deadline (client's or `request_timeout_s`) passed while it ran; it was
    aborted and its blocks freed."""

    code = "deadline_exceeded"


class UnavailableError(RouterError):
    """The server is draining (shutting down): it takes no new requests."""

    code = "unavailable"


class RequestNotFoundError(RouterError):
    """No queued or running request has this id."""

    code = "not_found"


def _leading_field(message: str) -> str | None:
    match = re.match(r"[a-z_]+", message)
    return match.group(0) if match else None

"""What the upstream stream decoders share: their shape and the in-stream error map.

A decoder takes one stream's body, read by read: ``decode(chunk) -> list[StreamEvent]``
gives the events the bytes completed. Then ``error``, when set, is the failure to raise
once those events are out (an error object in the stream, a payload that is not JSON),
and ``done`` says the protocol's end (``terminator``) was met: the body must end there.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from ..errors import (
    UpstreamAuthError,
    UpstreamError,
    UpstreamInvalidRequest,
    UpstreamOverloaded,
    UpstreamRateLimited,
)
from ..events import StreamEvent

__all__ = ["UpstreamDecoder", "in_stream_error"]


class UpstreamDecoder(Protocol):
    terminator: ClassVar[str]
    done: bool
    error: UpstreamError | None

    def decode(self, chunk: bytes) -> list[StreamEvent]: ...


_IN_STREAM: dict[str, tuple[type[UpstreamError], int | None]] = {
    "invalid_request_error": (UpstreamInvalidRequest, None),
    "not_found_error": (UpstreamInvalidRequest, 404),
    "rate_limit_error": (UpstreamRateLimited, None),
    "overloaded_error": (UpstreamOverloaded, None),
}


def in_stream_error(provider: str, error: Any) -> UpstreamError:
    """The error for an error object met inside the stream (OpenAI ``{"error": {...}}``,
    Anthropic's ``error`` event: docs/protocols.md §2, §3).

    Its ``type`` picks the class, hence the status if no output went out yet (a request
    the upstream refused stays a 4xx) and whether another target may be tried; the type
    and the code (``upstream_error`` if none) reach the client as they came.
    """
    if not isinstance(error, dict):
        error = {"message": str(error)}
    kind = error.get("type")
    kind = kind if isinstance(kind, str) and kind else None
    if kind in ("authentication_error", "permission_error"):
        return UpstreamAuthError(provider, f" ({kind})")
    cls, status = _IN_STREAM.get(kind or "", (UpstreamError, None))
    code = error.get("code")
    return cls(
        f"provider {provider!r}: {error.get('message') or 'error inside the stream'}",
        code=code if isinstance(code, str) and code else "upstream_error",
        status=status,
        error_type=kind,
    )

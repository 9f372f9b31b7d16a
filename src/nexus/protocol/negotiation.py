"""Choosing a stream format for a request, and a realtime socket's subprotocol. Pure
functions over strings.

Precedence: ``?stream_format=``, ``X-Nexus-Stream-Format``, ``Accept``, the endpoint's
default. A name in the query or header must be a registered media type or alias
(case-insensitive), else ``unsupported_stream_format``. ``Accept`` never fails (SDKs
send ``application/json`` on streaming calls): each registered type takes the quality
of the most specific matching range (RFC 9110 §12.5.1), ``q=0`` excludes, and ties go
to the more specific range, the one written first, the default, then registration
order. An ``Accept`` of the media type the default is sent as picks the default.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import InvalidRequest, UnsupportedStreamFormat

__all__ = [
    "REALTIME_SUBPROTOCOL",
    "AcceptRange",
    "parse_accept",
    "select_format",
    "select_subprotocol",
]

REALTIME_SUBPROTOCOL = "nexus.v1"
"""The one subprotocol ``/v1/realtime`` speaks (a browser offers it beside ``nexus-key.<key>``)."""


def select_subprotocol(offered: Sequence[str]) -> str | None:
    """The subprotocol a realtime handshake is answered with: :data:`REALTIME_SUBPROTOCOL`
    when offered, None when nothing is. Never one of the others: ``nexus-key.<key>`` would
    send the key back in a response header, and any other is one the gateway does not
    speak. Yet a client that offers subprotocols must get one of them back or, per the
    WHATWG WebSocket standard browsers follow, fail the connection (RFC 6455 4.1 lets a
    client go on without one): so offering some but not this one raises 400
    ``invalid_request``, an answer a browser can report, rather than an upgrade it drops.
    The message names no offered value (one may be a key)."""
    if REALTIME_SUBPROTOCOL in offered:
        return REALTIME_SUBPROTOCOL
    if not offered:
        return None
    raise InvalidRequest(
        f"Sec-WebSocket-Protocol: offer {REALTIME_SUBPROTOCOL!r}, the subprotocol this "
        "endpoint speaks (beside nexus-key.<key> when the key travels there), or no "
        "subprotocol at all.",
        param="Sec-WebSocket-Protocol",
    )


class FormatTable(Protocol):
    """What negotiation needs of a registry."""

    def resolve(self, name: str) -> str | None:
        """The media type a name or alias stands for, or None."""

    def media_types(self) -> Sequence[str]:
        """Registered media types in registration order."""

    def describe(self) -> str:
        """A human list of formats and aliases, for error messages."""

    def content_type(self, media_type: str) -> str:
        """The ``Content-Type`` a registered format is sent with."""


@dataclass(frozen=True, slots=True)
class AcceptRange:
    type: str
    subtype: str
    q: float
    position: int

    @property
    def specificity(self) -> int:
        if self.type == "*":
            return 0
        return 1 if self.subtype == "*" else 2

    def matches(self, media_type: str) -> bool:
        if self.type == "*":
            return True
        main, _, sub = media_type.partition("/")
        return self.type == main and (self.subtype == "*" or self.subtype == sub)


MAX_ACCEPT_RANGES = 32
"""Ranges of an ``Accept`` header looked at; the rest are not (a client's 8 KB header of
thousands cost 5 ms each time, before its key's rate was checked)."""


def parse_accept(header: str) -> list[AcceptRange]:
    """Parse an ``Accept`` header leniently: a malformed range is skipped, a ``q`` that
    is not a finite number counts as 0; only the first :data:`MAX_ACCEPT_RANGES`."""
    ranges = []
    items = header[: 64 * MAX_ACCEPT_RANGES].split(",", MAX_ACCEPT_RANGES)[:MAX_ACCEPT_RANGES]
    for position, item in enumerate(items):
        parts = [p.strip() for p in item.split(";")]
        media = parts[0].lower()
        main, slash, sub = media.partition("/")
        if not slash or not main or not sub or (main == "*" and sub != "*"):
            continue
        q = 1.0
        for param in parts[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
                q = min(max(q, 0.0), 1.0) if math.isfinite(q) else 0.0
        ranges.append(AcceptRange(main, sub, q, position))
    return ranges


def select_format(
    query: str | None,
    header: str | None,
    accept: str | None,
    default: str,
    formats: FormatTable,
) -> str:
    """The media type to stream in (a ``None`` source is absent). Raises
    :class:`UnsupportedStreamFormat` when ``query`` or ``header`` names no format."""

    for source, name in (("stream_format", query), ("X-Nexus-Stream-Format", header)):
        if name is None:
            continue
        media_type = formats.resolve(name)
        if media_type is None:
            raise UnsupportedStreamFormat(
                f"Unsupported stream format {name.strip()!r} in {source}. "
                f"Registered formats: {formats.describe()}.",
                param=source,
            )
        return media_type
    if accept:
        types = tuple(formats.media_types())
        chosen = (
            _accepted(accept, default, types)
            if len(accept) <= _CACHED_ACCEPT
            else _best_accepted(parse_accept(accept), default, types)
        )
        if chosen is not None:
            # ``Accept: text/event-stream`` on an endpoint whose own format is sent as
            # text/event-stream (Anthropic, Responses) means that format, not OpenAI's.
            if chosen != default and _bare(formats.content_type(default)) == chosen:
                return default
            return chosen
    return default


_CACHED_ACCEPT = 256
"""Longer ``Accept`` headers are ranked every time: the cache holds 64 KB of them at most."""


@functools.lru_cache(maxsize=256)
def _accepted(accept: str, default: str, media_types: tuple[str, ...]) -> str | None:
    """The best registered type for ``accept``, or None. Cached: a client sends the same
    ``Accept`` with every request, and parsing and ranking it cost ~10 µs."""
    return _best_accepted(parse_accept(accept), default, media_types)


def _bare(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _best_accepted(
    ranges: list[AcceptRange], default: str, media_types: Sequence[str]
) -> str | None:
    best: tuple[float, int, int, int, int] | None = None
    chosen = None
    for order, media_type in enumerate(media_types):
        matching = [r for r in ranges if r.matches(media_type)]
        if not matching:
            continue
        top = max(matching, key=lambda r: (r.specificity, -r.position))
        if top.q <= 0:
            continue
        key = (top.q, top.specificity, -top.position, media_type == default, -order)
        if best is None or key > best:
            best, chosen = key, media_type
    return chosen

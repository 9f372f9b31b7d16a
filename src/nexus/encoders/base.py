"""The encoder interface: one stream's events in, bytes out. Pure: no I/O.

The pump (:mod:`nexus.server.streaming`) makes one encoder per stream with the
stream's :class:`~nexus.types.StreamMeta` and writes, in order: ``start()``,
``encode(event)`` for each event (``error(event)`` for an error event, which
ends the stream), ``heartbeat()`` whenever the stream is idle for the
configured interval, and ``end()`` last. An empty ``bytes`` means "write
nothing". Encoders may keep per-stream state; they are never shared. The defaults
of ``error()``, ``heartbeat()`` and ``end()`` call ``encode()`` with an
:class:`~nexus.events.Error`, :class:`~nexus.events.Heartbeat` and
:class:`~nexus.events.Done`: an encoder that overrides none of them handles every
event type in ``encode()``.

An encoder writes one response: the pump sets :attr:`Encoder.request_id` to that
response's ``X-Request-Id`` before ``start()``, and error frames carry it (a stream
followed by several requests gets a different id in each one's error frame).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from ..events import Done, Error, Heartbeat, StreamEvent
from ..types import StreamMeta

__all__ = ["Encoder"]


class Encoder(ABC):
    """Base class for stream encoders; subclass, implement :meth:`encode` and
    :func:`nexus.register` it.

    Class attributes: ``media_type`` (required: what negotiation matches and the
    response announces; the class is registered under it), ``content_type``
    (the ``Content-Type`` header; defaults to ``media_type``) and ``aliases``
    (short names for ``?stream_format=``). ``event_ids``: whether the pump adds an
    ``id:`` line to each frame for resume (``None``: when the content type is
    ``text/event-stream``; frames are then separated by a blank line, LF LF).
    """

    media_type: ClassVar[str]
    content_type: ClassVar[str | None] = None
    aliases: ClassVar[tuple[str, ...]] = ()
    event_ids: ClassVar[bool | None] = None

    request_id: str | None = None
    """The ``X-Request-Id`` of the response this encoder writes, set by the pump after
    construction; None outside a request. Error frames carry it."""

    def __init__(self, meta: StreamMeta) -> None:
        self.meta = meta

    def start(self) -> bytes:
        """Bytes written right after the headers."""
        return b""

    @abstractmethod
    def encode(self, event: StreamEvent) -> bytes:
        """The frame for one event. The pump calls it for the stream's events and
        :meth:`error` for a mid-stream failure; but the defaults of :meth:`error`,
        :meth:`heartbeat` and :meth:`end` call it with an :class:`Error`,
        :class:`Heartbeat` and :class:`Done`, so it must handle those too unless
        they are overridden."""

    def error(self, event: Error) -> bytes:
        """The frame for a mid-stream failure; ``end()`` follows it. By default,
        ``encode(event)``."""
        return self.encode(event)

    def heartbeat(self) -> bytes:
        """The keepalive frame written when the stream has been idle. By default,
        ``encode(Heartbeat())``."""
        return self.encode(Heartbeat())

    def end(self) -> bytes:
        """The terminal frame, after the last event (and after an error). By default,
        ``encode(Done())``."""
        return self.encode(Done())

"""The encoder interface: one stream's events in, bytes out. Pure: no I/O.

The pump (:mod:`nexus.server.streaming`) makes one encoder per stream with the
stream's :class:`~nexus.types.StreamMeta` and writes, in order: ``start()``,
``encode(event)`` for each event (``error(event)`` for an error event, which
ends the stream), ``heartbeat()`` whenever the stream is idle for the
configured interval, and ``end()`` last. An empty ``bytes`` means "write
nothing". Encoders may keep per-stream state; they are never shared.

An encoder writes one response: the pump sets :attr:`Encoder.request_id` to that
response's ``X-Request-Id`` before ``start()``, and error frames carry it (a stream
followed by several requests gets a different id in each one's error frame).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from ..events import Done, Error, StreamEvent
from ..types import StreamMeta

__all__ = ["Encoder"]


class Encoder(ABC):
    """Base class for stream encoders; subclass and :func:`nexus.register` it.

    Class attributes: ``media_type`` (what negotiation matches), ``content_type``
    (the ``Content-Type`` header; defaults to ``media_type``) and ``aliases``
    (short names for ``?stream_format=``). ``event_ids``: whether the pump adds an
    ``id:`` line to each frame for resume (``None``: when the content type is
    ``text/event-stream``; frames are then separated by a blank line, LF LF).
    """

    media_type: ClassVar[str]
    content_type: ClassVar[str | None] = None
    aliases: ClassVar[tuple[str, ...]] = ()
    event_ids: ClassVar[bool | None] = None

    content_frame: tuple[bytes, bytes] | None = None
    """``(head, tail)`` when the frame of a delta carrying only content (the commonest
    event by far) is ``head + <the content as a JSON string> + tail``, one frame with no
    state behind it: the pump then builds it without calling :meth:`encode`. Set
    :attr:`frame_encode` to the ``encode`` it stands for: a subclass that overrides
    ``encode`` is then called as usual."""
    frame_encode: ClassVar[Callable[..., bytes] | None] = None

    def uses_content_frame(self) -> tuple[bytes, bytes] | None:
        """:attr:`content_frame`, if this class's ``encode`` is the one it stands for."""
        cls = type(self)
        if self.content_frame is None or cls.encode is not cls.frame_encode:
            return None
        return self.content_frame

    def encode_texts(self, texts: list[str]) -> list[bytes] | None:
        """The frames of consecutive deltas that carry only content, one per text (``b""``
        for one that writes nothing), exactly what :meth:`encode` would give for each in
        turn; or None, with nothing changed, when the encoder's state does not allow it
        now (a block or an item to open first): the pump then calls :meth:`encode` for
        the first of them and asks again for the rest.

        For stateful formats whose content frames differ from one to the next (a
        sequence number, a block index), where :attr:`content_frame` cannot serve: one
        call per run of content deltas instead of one per delta. Declare
        :attr:`frame_encode` too; a subclass that overrides ``encode`` is then called
        as usual. The default returns None.
        """
        return None

    def uses_encode_texts(self) -> bool:
        """Whether the pump may call :meth:`encode_texts` (declared, and this class's
        ``encode`` is the one it stands for)."""
        cls = type(self)
        return cls.encode_texts is not Encoder.encode_texts and cls.encode is cls.frame_encode

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
        """The frame for one event (never called with :class:`Error`)."""

    def error(self, event: Error) -> bytes:
        """The frame for a mid-stream failure; ``end()`` follows it."""
        return self.encode(event)

    @abstractmethod
    def heartbeat(self) -> bytes:
        """The keepalive frame written when the stream has been idle."""

    def end(self) -> bytes:
        """The terminal frame, after the last event (and after an error)."""
        return self.encode(Done())

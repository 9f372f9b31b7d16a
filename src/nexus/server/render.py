"""A stream's log rendered in any format, from any point: event ids and resume points.

Sans-I/O: the pump (:mod:`nexus.server.streaming`) writes what it returns.

A stream's log is its events in order, the last one terminal (:class:`Done`,
or an :class:`Error`). Rendering numbers *steps*: step 0 is the encoder's
``start()``, step *i* is log entry *i - 1*; a terminal ``Done`` is ``end()``,
a terminal ``Error`` two steps, ``error()`` then ``end()``, and so is an aborted ``Done``
(a ``stream_cancelled`` error: a stream cut short never reads as a whole answer). Every SSE
frame carries an ``id:`` that names the stream and the step::

    id: chatcmpl-4f0c...e1.7        the last (usually the only) frame of step 7
    id: chatcmpl-4f0c...e1.7.0      an earlier frame of step 7 (steps that write several)

A client that saw ``<stream>.7`` resumes at step 8; one that saw ``<stream>.7.0``
gets step 7's frames after the first. Encoders keep state (Anthropic's block
indices, the Responses sequence numbers), so a resumed rendering runs the
encoder over the skipped steps too and throws their bytes away: output after
the resume point is byte-for-byte what the first rendering wrote (a resume is never
padded with ``include_obfuscation``: that option is the first request's). Formats
without ids (NDJSON) resume by count: ``last_event_id=7`` is "seven event
lines received". A client that counts frames instead (the Responses API's
``starting_after``, a sequence number: frame *n* of the rendering) resumes with a
:class:`Cursor` of ``frames``: every frame after the first ``frames``, ids as the first
rendering wrote them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..encoders.base import Encoder
from ..errors import InvalidLastEventId
from ..events import Done, Error, StreamEvent

__all__ = ["ABORTED", "Cursor", "Renderer", "parse_cursor", "uses_event_ids"]

_CURSOR = re.compile(r"(?:([A-Za-z0-9_-]{8,128})\.)?([0-9]{1,12})(?:\.([0-9]{1,6}))?")
_FRAME_END = b"\n\n"
ABORTED = Error(
    error_type="server_error",
    message="The stream was aborted before its end.",
    code="stream_cancelled",
)
"""What an aborted ``Done`` renders as: a stream cut short never reads as whole."""


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a client is in a stream: it has every frame up to and including this one."""

    stream_id: str | None
    step: int
    frame: int | None = None
    frames: int | None = None
    """Instead of a step: how many frames of the rendering the client has (for a format
    that numbers its frames itself, as the Responses API's ``sequence_number``)."""

    def __str__(self) -> str:
        if self.frames is not None:
            return f"{self.frames} frames"
        head = f"{self.stream_id}.{self.step}" if self.stream_id else str(self.step)
        return head if self.frame is None else f"{head}.{self.frame}"


def parse_cursor(text: str) -> Cursor:
    """Parse a ``Last-Event-ID``. Raises :class:`InvalidLastEventId`."""
    match = _CURSOR.fullmatch(text.strip())
    if match is None:
        raise InvalidLastEventId(
            f"Last-Event-ID {text[:80]!r} is not an event id of this gateway "
            "('<stream id>.<step>' from an id: line, or a count of events received).",
            param="last_event_id",
        )
    stream_id, step, frame = match.groups()
    return Cursor(stream_id, int(step), None if frame is None else int(frame))


def uses_event_ids(encoder: type[Encoder]) -> bool:
    """Whether the format is SSE, whose frames get ``id:`` lines."""
    if encoder.event_ids is not None:
        return encoder.event_ids
    content_type = encoder.content_type or encoder.media_type
    return content_type.split(";")[0].strip().lower() == "text/event-stream"


class Renderer:
    """One client's view of one log: the encoder, the ids, the resume point.

    The pump calls :meth:`begin` once, then :meth:`feed` with the log's entries in
    order (in batches as they arrive); :attr:`done` is true once the terminal
    entry was rendered. :attr:`written` is how many steps wrote bytes: the events the
    client got (the format's opening, each entry rendered, an error, the terminator),
    never what a resume skipped or a format leaves out; :attr:`wrote`, whether any did
    (a resume past the end writes nothing).
    """

    __slots__ = (
        "_after",
        "_encoder",
        "_ids",
        "_prefix",
        "_skip",
        "done",
        "resumed",
        "step",
        "written",
    )

    def __init__(
        self, encoder: Encoder, stream_id: str, *, ids: bool, after: Cursor | None = None
    ) -> None:
        self._encoder = encoder
        self._ids = ids
        self._prefix = b"id: " + stream_id.encode("ascii") + b"."
        self._after = after  # the resume point, until rendering passes it
        self._skip = 0 if after is None or after.frames is None else after.frames
        self.resumed = after is not None
        self.step = 0
        self.done = False
        self.written = 0

    def begin(self) -> bytes:
        data = self._out(0, self._encoder.start())
        self.written += 1 if data else 0
        return data

    def feed(self, events: Sequence[StreamEvent]) -> bytes:
        """The bytes for the next entries of the log."""
        encoder = self._encoder
        encode = encoder.encode
        ids = self._ids
        prefix = self._prefix
        parts: list[bytes] = []
        step = self.step
        for event in events:
            step += 1
            cls = type(event)
            if cls is Error or (cls is Done and event.aborted):  # type: ignore[union-attr]
                # Two steps: the error, then the terminator (an NDJSON client that
                # counted the error line still gets the done line).
                error = event if cls is Error else ABORTED
                data = self._out(step, encoder.error(error))  # type: ignore[arg-type]
                if data:
                    parts.append(data)
                step += 1
            if cls is Error or cls is Done:
                data = self._out(step, encoder.end())
                if data:
                    parts.append(data)
                self.done = True
                break
            data = encode(event)
            # Only steps that wrote bytes are kept: each is an event the client got.
            if self._after is not None:
                data = self._out(step, data)
                if data:
                    parts.append(data)
            elif ids and data:
                if _several(data):
                    data = self._number(step, _frames(data), 0)
                else:
                    data = prefix + b"%d\n" % step + data  # one frame: the commonest case
                parts.append(data)
            elif data:
                parts.append(data)
        self.step = step
        if not parts:
            return b""
        self.written += len(parts)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def wrote(self) -> bool:
        return self.written > 0

    def heartbeat(self) -> bytes:
        return self._encoder.heartbeat()

    def fail(self, event: Error) -> bytes:
        """A gateway-made error (shutdown, internal) and the terminator, without ids.

        It is not in the log: a client that resumes after it picks up at its
        last real event. The error goes out even when the encoder's ``end()`` raises
        (the failure it is often telling: then there is no terminator to write).
        """
        self.done = True
        error = self._encoder.error(event)
        try:
            end = self._encoder.end()
        except Exception:
            end = b""
        self.written += bool(error) + bool(end)
        return error + end

    def _out(self, step: int, data: bytes) -> bytes:
        """``data`` for ``step`` with its ids, less what the resume point says the client
        has."""
        after = self._after
        if after is not None and after.frames is not None:
            return self._past_frames(step, data)
        if after is not None:
            if step < after.step:
                return b""
            self._after = None
            if step == after.step:
                if after.frame is None or not self._ids:
                    return b""
                frames = _frames(data)
                skip = after.frame + 1
                if skip >= len(frames):
                    return b""
                return self._number(step, frames[skip:], skip)
        if not data:
            return data
        if not self._ids:
            return data
        if not _several(data):
            return self._prefix + b"%d\n" % step + data
        return self._number(step, _frames(data), 0)

    def _past_frames(self, step: int, data: bytes) -> bytes:
        """``data`` less the frames a client that counts frames has (``Cursor.frames``)."""
        if not data:
            return data
        frames = _frames(data)
        skip = self._skip
        if skip >= len(frames):
            self._skip = skip - len(frames)
            return b""
        self._after = None
        if self._ids:
            return self._number(step, frames[skip:], skip)
        return b"".join(frames[skip:])

    def _number(self, step: int, frames: list[bytes], first: int) -> bytes:
        last = first + len(frames) - 1
        out = []
        for index, frame in enumerate(frames, first):
            if index == last:
                line = self._prefix + b"%d\n" % step
            else:
                line = self._prefix + b"%d.%d\n" % (step, index)
            if frame.startswith(b"retry:"):  # SSE responses open with their retry line
                head, _, rest = frame.partition(b"\n")
                out.append(head + b"\n" + line + rest)
            else:
                out.append(line + frame)
        return b"".join(out)


def _several(data: bytes) -> bool:
    """Whether ``data`` is more than one SSE frame, or opens with the retry line.

    A blank line before the end, found line by line (``find`` of one byte is a
    ``memchr``; a frame has a line or two)."""
    end = len(data) - 2
    at = data.find(b"\n")
    while 0 <= at < end:  # (-1: no newline left)
        if data[at + 1] == 10:
            return True
        at = data.find(b"\n", at + 1)
    return data.startswith(b"retry:")


def _frames(data: bytes) -> list[bytes]:
    """SSE frames, each with its blank line; a trailing partial frame counts as one."""
    pieces = data.split(_FRAME_END)
    frames = [piece + _FRAME_END for piece in pieces[:-1] if piece]
    if pieces[-1]:
        frames.append(pieces[-1])
    return frames

"""Event ids and resume points: a stream's log rendered in any format, from any point. Sans-I/O.

A stream's log is its events in order, the last one terminal (:class:`Done`,
or an :class:`Error`). Rendering numbers *steps*: step 0 is the encoder's
``start()``, step *i* is log entry *i - 1*; a terminal ``Done`` is ``end()``,
a terminal ``Error`` two steps, ``error()`` then ``end()``. Every SSE frame carries an ``id:``
that names the stream and the step::

    id: chatcmpl-4f0c...e1.7        the last (usually the only) frame of step 7
    id: chatcmpl-4f0c...e1.7.0      an earlier frame of step 7 (steps that write several)

A client that saw ``<stream>.7`` resumes at step 8; one that saw ``<stream>.7.0``
gets step 7's frames after the first. Encoders keep state (Anthropic's block
indices, the Responses sequence numbers), so a resumed rendering runs the
encoder over the skipped steps too and throws their bytes away: output after
the resume point is byte-for-byte what the first rendering wrote. Formats
without ids (NDJSON) resume by count: ``last_event_id=7`` is "seven event
lines received".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from ..encoders.base import Encoder
from ..errors import InvalidLastEventId
from ..events import Delta, Done, Error, StreamEvent, content_delta

__all__ = ["Cursor", "Renderer", "parse_cursor", "uses_event_ids"]

_CURSOR = re.compile(r"(?:([A-Za-z0-9_-]{8,128})\.)?([0-9]{1,12})(?:\.([0-9]{1,6}))?")
_FRAME_END = b"\n\n"
_dumps = orjson.dumps
_NUMBERED = 4096
_NUMBERS = [b"%d\n" % step for step in range(_NUMBERED)]
"""The ends of the first steps' id lines, made once (a step's id is formatted per event)."""


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a client is in a stream: it has every frame up to and including this one."""

    stream_id: str | None
    step: int
    frame: int | None = None

    def __str__(self) -> str:
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
    entry was rendered. :attr:`wrote` tells whether anything came out at all (a
    resume past the end writes nothing).
    """

    __slots__ = (
        "_content_frame",
        "_encode",
        "_encoder",
        "_ids",
        "_prefix",
        "_skip_frame",
        "_skip_step",
        "_skipping",
        "_texts",
        "done",
        "resumed",
        "step",
        "wrote",
    )

    def __init__(
        self, encoder: Encoder, stream_id: str, *, ids: bool, after: Cursor | None = None
    ) -> None:
        self._encoder = encoder
        self._encode = encoder.encode
        self._content_frame = encoder.uses_content_frame()
        self._texts = self._content_frame is None and encoder.uses_encode_texts()
        self._ids = ids
        self._prefix = b"id: " + stream_id.encode("ascii") + b"."
        self._skipping = after is not None
        self.resumed = after is not None
        self._skip_step = after.step if after is not None else -1
        self._skip_frame = after.frame if after is not None else None
        self.step = 0
        self.done = False
        self.wrote = False

    def begin(self) -> bytes:
        return self._out(0, self._encoder.start())

    def feed(self, events: Sequence[StreamEvent]) -> bytes:
        """The bytes for the next entries of the log."""
        encode = self._encode
        ids = self._ids
        prefix = self._prefix
        parts: list[bytes] = []
        extend = parts.extend
        step = self.step
        frame = self._content_frame if not self._skipping else None
        head, tail = frame if frame is not None else (b"", b"")
        texts = self._texts if not self._skipping else False
        fast = frame is not None or texts
        pending: list[str] = []  # content for encode_texts, from step ``first`` on
        first = 0
        numbers = _NUMBERS
        for event in events:
            step += 1
            cls = type(event)
            if cls is Delta and fast:
                content = event.content  # type: ignore[union-attr]
                if (
                    content is not None
                    and event.finish_reason is None  # type: ignore[union-attr]
                    and event.tool_calls is None  # type: ignore[union-attr]
                    and event.role is None  # type: ignore[union-attr]
                    and event.refusal is None  # type: ignore[union-attr]
                ):
                    # plain_content(): the encoder's frame, built here without a call.
                    if frame is None:
                        if not pending:
                            first = step
                        pending.append(content)
                    elif ids:
                        number = numbers[step] if step < _NUMBERED else b"%d\n" % step
                        extend((prefix, number, head, _dumps(content), tail))
                    else:
                        extend((head, _dumps(content), tail))
                    continue
            if pending:
                self._texts_out(pending, first, parts)
                pending = []
            if cls is Error:
                # Two steps: the error, then the terminator (an NDJSON client that
                # counted the error line still gets the done line).
                self._emit(step, self._encoder.error(event), parts)  # type: ignore[arg-type]
                step += 1
                self._emit(step, self._encoder.end(), parts)
                self.done = True
                break
            if cls is Done:
                self._emit(step, self._encoder.end(), parts)
                self.done = True
                break
            data = encode(event)
            if self._skipping:
                self._emit(step, data, parts)
            elif data:
                if ids:
                    # One frame gets its id line in front, unless it opens with the
                    # response's retry line (a format that writes it with its first event).
                    if data.count(_FRAME_END) == 1 and not data.startswith(b"retry:"):
                        data = prefix + b"%d\n" % step + data
                    else:
                        data = self._with_ids(step, data)
                parts.append(data)
        if pending:
            self._texts_out(pending, first, parts)
        self.step = step
        if not parts:
            return b""
        self.wrote = True
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _texts_out(self, texts: list[str], step: int, parts: list[bytes]) -> None:
        """The frames of consecutive plain content deltas from ``step`` on, through the
        encoder's :meth:`~nexus.encoders.base.Encoder.encode_texts` (one call for them
        all), or :meth:`encode` for one at a time while the encoder is not ready: asked
        again after each delta that wrote something (which may have changed its state),
        so that a run it cannot take costs one call per delta, not one per delta left."""
        encoder = self._encoder
        at = 0
        ready = True
        while at < len(texts):
            frames = encoder.encode_texts(texts[at:] if at else texts) if ready else None
            if frames is None:
                data = self._encode(content_delta(texts[at]))
                if data:
                    parts.append(self._with_ids(step, data) if self._ids else data)
                ready = bool(data)
                step += 1
                at += 1
                continue
            if self._ids:
                prefix = self._prefix
                for data in frames:
                    if data:  # nothing to write, no id (as for encode())
                        number = _NUMBERS[step] if step < _NUMBERED else b"%d\n" % step
                        parts += (prefix, number, data)
                    step += 1
            else:
                parts += frames
            return

    def _emit(self, step: int, data: bytes, parts: list[bytes]) -> None:
        data = self._out(step, data)
        if data:
            parts.append(data)

    def heartbeat(self) -> bytes:
        return self._encoder.heartbeat()

    def fail(self, event: Error) -> bytes:
        """A gateway-made error (shutdown, internal) and the terminator, without ids.

        It is not in the log: a client that resumes after it picks up at its
        last real event.
        """
        self.done = True
        self.wrote = True
        return self._encoder.error(event) + self._encoder.end()

    def _out(self, step: int, data: bytes) -> bytes:
        """``data`` for ``step``, less what the resume point says the client has."""
        if self._skipping:
            if step < self._skip_step:
                return b""
            if step == self._skip_step:
                if self._skip_frame is None or not self._ids:
                    self._skipping = False
                    return b""
                frames = _frames(data)[self._skip_frame + 1 :]
                self._skipping = False
                if not frames:
                    return b""
                data = self._number(step, frames, len(_frames(data)) - len(frames))
                self.wrote = True
                return data
            self._skipping = False
        if data and self._ids:
            data = self._with_ids(step, data)
        if data:
            self.wrote = True
        return data

    def _with_ids(self, step: int, data: bytes) -> bytes:
        return self._number(step, _frames(data), 0)

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


def _frames(data: bytes) -> list[bytes]:
    """SSE frames, each with its blank line; a trailing partial frame counts as one."""
    pieces = data.split(_FRAME_END)
    frames = [piece + _FRAME_END for piece in pieces[:-1] if piece]
    if pieces[-1]:
        frames.append(pieces[-1])
    return frames

"""Server-Sent Events, both ways, without I/O (docs/protocols.md §1).

:func:`frame` writes one event; :class:`SSEDecoder` parses a byte stream with the
WHATWG rules: ``decode(chunk) -> list[ServerSentEvent]`` for each chunk as it
arrives (split anywhere: inside a UTF-8 sequence, between CR and LF), then
``flush()`` at end of input.

An event (or a line) held between reads is bounded: past ``max_event_bytes`` of input
since the last blank line, :meth:`SSEDecoder.decode` raises :class:`EventTooLarge`, so a
peer that never ends a line cannot make the decoder hold it all.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

__all__ = [
    "HOLD_BYTES",
    "MAX_EVENT_BYTES",
    "EventTooLarge",
    "SSEDecoder",
    "ServerSentEvent",
    "comment",
    "frame",
]

_LINE_END = re.compile(r"\r\n|\r|\n")

MAX_EVENT_BYTES = 8 * 1024 * 1024
"""The default bound of :class:`SSEDecoder`: far above any chat event (a token, a tool
call's fragment, a usage), below what one stream may cost the process in memory."""


_BOM = codecs.BOM_UTF8

HOLD_BYTES = 16 * 1024
"""The start of an event held as bytes between reads (it is copied into the next read):
a chat chunk is well under it; a longer event (an image, a long tool call) is read by the
line rules, in linear time."""


class EventTooLarge(ValueError):
    """The input held for one event passed the decoder's ``max_event_bytes``."""


def frame(
    data: str | bytes,
    *,
    event: str | None = None,
    id: str | None = None,
    retry: int | None = None,
) -> bytes:
    """One SSE event as bytes: optional ``event:``/``id:``/``retry:``, then ``data:`` lines
    (one per line of the payload; a decoder joins them back with LF)."""
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    out = []
    if event is not None:
        _check_field("event", event)
        out.append(f"event: {event}\n")
    if id is not None:
        if "\0" in id:
            raise ValueError("an SSE id must not contain NUL")
        _check_field("id", id)
        out.append(f"id: {id}\n")
    if retry is not None:
        if retry < 0:
            raise ValueError("an SSE retry must be a non-negative integer")
        out.append(f"retry: {int(retry)}\n")
    for line in _LINE_END.split(data):
        out.append(f"data: {line}\n")
    out.append("\n")
    return "".join(out).encode("utf-8")


def comment(text: str = "") -> bytes:
    """A comment line, ignored by every decoder: the keepalive of SSE."""
    _check_field("comment", text)
    return f": {text}\n\n".encode() if text else b":\n\n"


def _check_field(name: str, value: str) -> None:
    if "\r" in value or "\n" in value:
        raise ValueError(f"an SSE {name} must not contain CR or LF")


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """A dispatched event. ``id`` is the last event id in force when it was dispatched."""

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


class SSEDecoder:
    """Incremental WHATWG ``text/event-stream`` parser.

    ``max_event_bytes`` bounds the input held for one event between reads (its lines,
    and a line still arriving): counted read by read from the last blank line, so that
    the check costs one comparison a read whose end falls inside an event, and nothing
    for the reads of whole events. A read itself is not bounded here: the caller's
    transport bounds its reads.
    """

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._hold_max = min(HOLD_BYTES, max_event_bytes)
        self._held = 0  # input bytes since the last blank line, while an event is held
        self._last_byte = 0  # the last byte read (a line's end: the next may end a blank line)
        self._text = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
        self._pending: list[str] = []  # the line so far, in pieces
        self._skip_lf = False
        self._data: list[str] = []
        self._event = ""
        self._last_id = ""
        self._retry: int | None = None
        self._clean = False  # see _general
        self._fresh = True  # nothing read yet (a BOM may come)
        self._tail = b""  # the start of an event, held as bytes (see _read)

    @property
    def last_event_id(self) -> str:
        self._settle()  # an id line among the held bytes is in force already
        return self._last_id

    def decode(self, chunk: bytes) -> list[ServerSentEvent]:
        """Feed bytes; return the events completed by them."""
        events, payloads, last_id = self._read(chunk)
        if payloads:
            events += [
                ServerSentEvent(data.decode("utf-8", "replace"), "message", last_id)
                for data in payloads
            ]
        return events

    def decode_data(self, chunk: bytes) -> list[bytes]:
        """:meth:`decode`, giving only each event's data, as bytes: for upstreams whose
        events are told apart by their JSON, not their ``event:`` names (OpenAI), read by
        a JSON parser of bytes. Not UTF-8 checked: an event cut on bytes keeps invalid
        bytes that :meth:`decode`'s text has as U+FFFD (the caller decodes with
        ``errors="replace"`` what its parser refuses)."""
        events, payloads, _ = self._read(chunk)
        if events:
            return [event.data.encode() for event in events] + payloads
        return payloads

    def _read(self, chunk: bytes) -> tuple[list[ServerSentEvent], list[bytes], str]:
        """The events ``chunk`` completes: those read by the line rules, then the data of
        whole events cut on bytes, and the last event id in force for those.

        Most reads of every upstream are whole events, ``data: `` lines (OpenAI) or
        ``event: `` then ``data: `` lines (Anthropic), the last one often cut by the read:
        from a plain state (:meth:`_plain`) the whole ones are cut with ``split``, with no
        text decoder, line loop or per-line object, and the cut one is held as bytes
        (``_tail``, up to :data:`HOLD_BYTES`) until the next read completes it. Any
        other shape is read by the line rules, the held bytes first.
        """
        events: list[ServerSentEvent] = []
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        elif self._fresh and not (len(chunk) < 3 and _BOM.startswith(chunk)):
            # The first read: its BOM, if any, is skipped here, so that a big first read
            # (a fast upstream's) is cut on bytes too; the line rules read UTF-8 from now on.
            self._fresh = False
            if chunk.startswith(_BOM):
                chunk = chunk[3:]
            self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._clean = True
            if not self._plain():
                return self._general(chunk), [], ""
        elif not self._plain():
            end = chunk.find(b"\n\n") if self._clean and not self._skip_lf else -1
            if end < 0:
                return self._general(chunk), [], ""
            events = self._general(chunk[: end + 2])
            chunk = chunk[end + 2 :]
            if not self._plain():
                return events + self._general(chunk), [], ""
        if b"\r" in chunk:
            return events + self._general(chunk), [], ""
        cut = chunk.rfind(b"\n\n")
        if cut < 0:
            self._keep(chunk)
            return events, [], ""
        if chunk.startswith(b"data: "):
            # b"data: A\n\ndata: B\n\n" -> [b"A", b"B"] when the only LFs are the two after
            # each (a join and a memchr: faster than counting LFs).
            data = chunk[6:cut].split(b"\n\ndata: ")
            if b"\n" in b"".join(data):
                return events + self._general(chunk), [], ""
            self._keep(chunk[cut + 2 :])
            return events, data, self._last_id
        if chunk.startswith(b"event: "):
            # b"event: NAME\ndata: DATA\n\n", each with those two lines only.
            blocks = chunk[:cut].split(b"\n\n")
            if chunk.count(b"\n", 0, cut + 2) != 3 * len(blocks):
                return events + self._general(chunk), [], ""
            last_id = self._last_id
            named = []
            for block in blocks:
                name, data_line, value = block.partition(b"\ndata: ")
                if not data_line or not name.startswith(b"event: "):
                    return events + self._general(chunk), [], ""
                named.append(
                    ServerSentEvent(
                        value.decode("utf-8", "replace"),
                        name[7:].decode("utf-8", "replace") or "message",
                        last_id,
                    )
                )
            self._keep(chunk[cut + 2 :])
            return events + named, [], ""
        return events + self._general(chunk), [], ""

    def _keep(self, partial: bytes) -> None:
        """Hold the start of an event (no CR, no blank line) as bytes for the next read,
        up to :data:`HOLD_BYTES` (and ``max_event_bytes``); a longer one goes to the line
        rules, which keep it in pieces (and count it against ``max_event_bytes``)."""
        if len(partial) > self._hold_max:
            self._general(partial)
        else:
            self._tail = partial

    def _settle(self) -> None:
        """Read the held bytes by the line rules (they dispatch nothing: no blank line)."""
        if self._tail:
            tail, self._tail = self._tail, b""
            self._general(tail)

    def _general(self, chunk: bytes) -> list[ServerSentEvent]:
        text = self._text.decode(chunk)
        if chunk:
            self._fresh = False
            # After an ASCII byte the text decoder holds nothing back (and its BOM check
            # is done).
            self._clean = chunk[-1] < 0x80
        events = self._decode_text(text)
        if self._pending or self._data:
            self._hold(chunk)
        else:
            self._held = 0
        if chunk:
            self._last_byte = chunk[-1]
        return events

    def _hold(self, chunk: bytes) -> None:
        """Count ``chunk``, which left an event or a line held, towards the bound: from
        its last blank line (LF LF, CR CR or LF CR: every blank line has one of them); or
        from its start, when a blank line is split between the last read and this one (the
        last ended a line and this one starts with another end: a server that writes each
        event's closing LF apart); else in full."""
        cut = max(chunk.rfind(b"\n\n"), chunk.rfind(b"\r\r"), chunk.rfind(b"\n\r"))
        last = self._last_byte
        first = 1 if last == 13 and chunk[:1] == b"\n" else 0  # the LF of a split CRLF
        if cut >= 0:
            self._held = len(chunk) - cut - 2
        elif last in (10, 13) and chunk[first : first + 1] in (b"\n", b"\r"):
            self._held = len(chunk) - first - 1
        else:
            self._held += len(chunk)
        if self._held > self._max:
            self.flush()
            raise EventTooLarge(f"an event of more than {self._max} bytes (max_event_bytes)")

    def _plain(self) -> bool:
        """No event nor line half-read, nothing held in the text decoder."""
        return (
            self._clean
            and not self._pending
            and not self._data
            and not self._event
            and self._retry is None
            and not self._skip_lf
        )

    def _decode_text(self, text: str) -> list[ServerSentEvent]:
        if not text:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
        if "\r" not in text:
            return self._decode_lf(text)
        events: list[ServerSentEvent] = []
        start = 0
        # Only the new text is scanned for line ends, and the partial line is kept as
        # pieces: a long line arriving in many chunks costs linear, not quadratic, time.
        for match in _LINE_END.finditer(text):
            end = match.start()
            if match.group() == "\r" and match.end() == len(text):
                # A CR at the end of the input may be the first half of CRLF.
                self._skip_lf = True
            if self._pending:
                self._pending.append(text[start:end])
                line = "".join(self._pending)
                self._pending = []
            else:
                line = text[start:end]
            event = self._line(line)
            if event is not None:
                events.append(event)
            start = match.end()
        if start < len(text):
            self._pending.append(text[start:])
        return events

    def _decode_lf(self, text: str) -> list[ServerSentEvent]:
        """The same rules for text whose lines all end in LF (what servers send), on
        ``str.split`` rather than a regex: the per-event cost of every upstream."""

        lines = text.split("\n")
        tail = lines.pop()  # after the last LF: a line still arriving ("" if none)
        events: list[ServerSentEvent] = []
        if lines:
            if self._pending:
                self._pending.append(lines[0])
                lines[0] = "".join(self._pending)
                self._pending = []
            data = self._data
            for line in lines:
                if line.startswith("data: "):
                    data.append(line[6:])
                elif not line:
                    event = self._dispatch()
                    if event is not None:
                        events.append(event)
                        data = self._data
                else:
                    self._line(line)
                    data = self._data
        if tail:
            self._pending.append(tail)
        return events

    def flush(self) -> list[ServerSentEvent]:
        """End of input. An event without its closing blank line is dropped (§1, rule 6)."""
        self._settle()
        self._text.decode(b"", final=True)
        self._held = 0
        self._pending = []
        self._data = []
        self._event = ""
        self._skip_lf = False
        return []

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data:
            self._event = ""
            return None
        data = self._data
        event = ServerSentEvent(
            data[0] if len(data) == 1 else "\n".join(data),
            self._event or "message",
            self._last_id,
            self._retry,
        )
        self._data = []
        self._event = ""
        self._retry = None
        return event

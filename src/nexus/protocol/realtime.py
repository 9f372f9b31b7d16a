"""The realtime WebSocket protocol as a state machine. Sans-I/O.

The route feeds each received frame to :class:`RealtimeSession` and carries out
what it returns: :class:`Send` a frame, :class:`StartTurn` with a validated
request, :class:`AbortTurn`. It tells the session whether the engine took the
turn (:meth:`~RealtimeSession.start_accepted`, which uses up the pending
input, or :meth:`~RealtimeSession.start_refused`, which keeps it) and when a turn
is over (:meth:`~RealtimeSession.turn_ended`). Nothing here awaits or touches a
socket.

Client envelopes (discriminated on ``type``)::

    {"type":"start","request":{<chat-completions request>}}
    {"type":"abort"}
    {"type":"audio_chunk","format":"pcm16"|"wav"|"mp3","b64":"...","sample_rate":24000}
    {"type":"image","mime_type":"image/png","b64":"..."}   (or "url" instead of "b64")

States: *idle* (no turn) and *streaming* (one turn in flight). ``start``
while streaming is refused with ``stream_in_progress`` and ``abort`` while idle
with ``nothing_to_abort``; both leave the turn and the connection as they are.
``audio_chunk`` and ``image`` are held as pending input (at most
``max_pending_input_bytes``: audio decoded, an image as its URL, and
``PENDING_ITEM_BYTES`` an item; at most ``max_json_items / 4`` items; else
``input_too_large``) and attached to the last user message of the next ``start``. Consecutive
``pcm16`` chunks of one sample rate are joined into one audio part.
Malformed frames get ``invalid_envelope``; an invalid request
``invalid_request`` naming the field, as does a request nested deeper than
``max_json_depth`` (counted as over HTTP). None of these close the connection,
unless ``max_invalid_frames`` frames in a row get nothing but such an error: then
:class:`Close` (1008) follows the last one, since every answer is larger than the
frame that asked for it and a client could otherwise have the gateway write many
times what it sends. A ``start`` the route refuses (its key's rate, its admission:
:meth:`RealtimeSession.refused`) is such a frame too.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
from pydantic import ValidationError

from ..request import (
    ChatRequest,
    ImagePart,
)
from .json_depth import (
    MAX_JSON_DEPTH,
    MAX_JSON_ITEMS,
    deep_field,
    more_items_than,
    too_deep,
    too_many_items,
)
from .openai_chat import validation_error
from .realtime_envelopes import (
    ENVELOPE,
    FRAME,
    KINDS,
    AbortEnvelope,
    AudioChunkEnvelope,
    Decoded,
    ImageEnvelope,
    Send,
    StartEnvelope,
    envelope_error,
    error_frame,
    flat_fields,
    kind_of,
    nested_error,
)
from .realtime_pending import PENDING_ITEM_BYTES, PendingAudio, PendingLedger, attach, to_part

__all__ = [
    "FRAME",
    "PENDING_ITEM_BYTES",
    "AbortTurn",
    "Close",
    "Decoded",
    "PendingLedger",
    "RealtimeSession",
    "Send",
    "StartTurn",
    "error_frame",
]


@dataclass(frozen=True, slots=True)
class StartTurn:
    request: ChatRequest  # to stream, the pending input attached


@dataclass(frozen=True, slots=True)
class AbortTurn:
    """Cancel the turn in flight; the route answers ``{"type":"done","aborted":true}``."""


@dataclass(frozen=True, slots=True)
class Close:
    """Close the connection with ``code`` and ``reason`` (after the frames before it)."""

    code: int
    reason: str


POLICY_VIOLATION = 1008
"""The close code of a peer that broke the connection's rules (RFC 6455 7.4.1)."""

STRIKES = frozenset(
    {
        "invalid_envelope",
        "invalid_request",
        "request_too_large",
        "nothing_to_abort",
        "stream_in_progress",
    }
)
"""The errors that answer a malformed or ill-timed frame, which count towards
``max_invalid_frames`` (``input_too_large`` does not: the input was well formed)."""

Action = Send | StartTurn | AbortTurn | Close


class RealtimeSession:
    """One connection's protocol state (see the module docstring)."""

    def __init__(
        self,
        *,
        max_pending_input_bytes: int,
        max_json_depth: int = MAX_JSON_DEPTH,
        max_json_items: int = MAX_JSON_ITEMS,
        request_id: str | None = None,
        ledger: PendingLedger | None = None,
        owner: str = "",
        max_invalid_frames: int = 16,
    ) -> None:
        self.max_pending_input_bytes = max_pending_input_bytes
        self.max_json_depth = max_json_depth
        self.max_json_items = max_json_items
        self.request_id = request_id
        """The ``X-Request-Id`` of the connection's handshake: every error frame has it."""
        self.streaming = False
        self._pending: list[ImagePart | PendingAudio] = []
        self._pending_bytes = 0
        self._ledger = ledger  # the key's pending input over all its connections
        self._owner = owner
        self.max_invalid_frames = max_invalid_frames
        self._strikes = 0  # frames in a row answered with nothing but a STRIKES error
        self._answering = FRAME  # the envelope type of the frame being answered

    def _error(self, code: str, message: str, *, param: str | None = None) -> Send:
        return error_frame(
            code, message, param=param, request_id=self.request_id, refused=self._answering
        )

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def receive_binary(self, data: bytes) -> list[Action]:
        self._answering = FRAME
        message = f"binary frames are not accepted ({len(data)} bytes received); send JSON "
        return self._judged([self._error("invalid_envelope", message + "envelopes as text frames")])

    def receive_text(self, text: str) -> list[Action]:
        """What to do about one text frame (see the module docstring): :meth:`decode`,
        then :meth:`receive_decoded`."""
        decoded = self.decode(text)
        if not isinstance(decoded, Decoded):
            return decoded
        return self.receive_decoded(decoded)

    def decode(self, text: str) -> Decoded | list[Action]:
        """A text frame read as far as its type, not yet validated (or the error to answer
        if it is no JSON object, or an envelope other than a start that nests). The costly
        steps come in :meth:`receive_decoded`: a route takes a token of the key's rate
        first for a ``start`` (:attr:`Decoded.start`), so that what a key can make the
        gateway parse, walk and validate is bounded by its rate."""
        self._answering = FRAME
        try:
            kind = kind_of(text).type  # skips the rest unbuilt: ~16x orjson's cost, less
        except msgspec.ValidationError:
            return self._judged(
                [self._error("invalid_envelope", "an envelope must be a JSON object")]
            )
        except (msgspec.DecodeError, UnicodeEncodeError, RecursionError) as exc:
            reason = "nests too deep" if type(exc) is RecursionError else exc
            return self._judged(
                [self._error("invalid_envelope", f"the frame is not valid JSON: {reason}")]
            )
        if kind in KINDS:
            self._answering = kind
        if kind == "start":
            return Decoded(None, text)
        try:
            return Decoded(flat_fields(text))
        except msgspec.ValidationError:
            return self._judged([nested_error(kind, text, self.request_id)])

    def receive_decoded(self, decoded: Decoded) -> list[Action]:
        """What to do about a frame :meth:`decode` read."""
        self._answering = "start" if decoded.start else FRAME
        data = decoded.data
        if data is not None and data.get("type") in KINDS:
            self._answering = data["type"]
        if data is None:
            try:
                data = orjson.loads(decoded.text)
            except orjson.JSONDecodeError as exc:  # (a number past 64 bits, say)
                message = f"the frame is not valid JSON: {exc}"
                return self._judged([self._error("invalid_envelope", message)])
        return self._judged(self._receive(data))

    def _judged(self, actions: list[Action]) -> list[Action]:
        """``actions``, and :class:`Close` when they make ``max_invalid_frames`` frames in
        a row answered with nothing but an error of :data:`STRIKES`."""
        if len(actions) == 1 and type(actions[0]) is StartTurn:
            return actions  # judged once the engine takes it or not (start_accepted, refused)
        if len(actions) != 1 or type(actions[0]) is not Send or actions[0].code not in STRIKES:
            self._strikes = 0
            return actions
        return self.refused(actions[0])

    def refused(self, frame: Send, strike: bool = True) -> list[Action]:
        """A ``start`` refused by the route (its key's rate, its admission) with ``frame``:
        a strike as an invalid frame is (``strike``: the route's call), since a client
        retrying at once would otherwise get an error frame for each of its small ones;
        :class:`Close` after the last. One that is no strike (a client that waited as it
        was told) neither counts nor clears the count."""
        if not strike:
            return [frame]
        self._strikes += 1
        if self._strikes < self.max_invalid_frames:
            return [frame]
        reason = f"{self._strikes} invalid frames in a row"
        return [frame, Close(POLICY_VIOLATION, reason)]

    def _receive(self, data: dict[str, Any]) -> list[Action]:
        if data.get("type") == "start":  # only a start's request nests: walked, bounded
            refused = self._too_deep(data)
            if refused is not None:
                return [refused]
        # Every other envelope holds scalars alone: one that nests fails its validation,
        # which stops at the first field that is not its own, unwalked. (Walking it cost
        # ~70 ms of the shared loop for a 400 KB frame, which takes no rate token.)
        try:
            envelope = ENVELOPE.validate_python(data)
        except ValidationError as exc:
            return [envelope_error(exc, data, self.request_id)]
        match envelope:
            case StartEnvelope():
                return self._start(envelope)
            case AbortEnvelope():
                if self.streaming:
                    return [AbortTurn()]
                return [self._error("nothing_to_abort", "abort received, but no stream is running")]
            case AudioChunkEnvelope():
                return self._add_audio(envelope)
            case ImageEnvelope():
                return self._add_image(envelope)
        raise AssertionError(envelope)  # pragma: no cover - the union is exhaustive

    def _too_deep(self, data: dict[str, Any]) -> Send | None:
        """A start's request is held to the limits it has over HTTP; the frame, one level
        more (its envelope) and a few values more."""
        if more_items_than(data, self.max_json_items + 8):
            message = too_many_items(self.max_json_items).message
            return self._error("request_too_large", message)
        limit = self.max_json_depth
        field = deep_field(data, limit + 1)
        if field is None:
            return None  # one walk: within it, a start's request is within its own limit
        request = data.get("request")
        if data.get("type") == "start" and isinstance(request, dict):
            inner = deep_field(request, limit)
            if inner is not None:
                error = too_deep(f"request.{inner}", limit)
                return self._error("invalid_request", error.message, param=error.param)
        return self._error("invalid_envelope", too_deep(field, limit).message, param=field)

    def turn_ended(self) -> None:
        self.streaming = False

    def _start(self, envelope: StartEnvelope) -> list[Action]:
        if self.streaming:
            message = "a stream is already running on this connection; send abort first"
            return [self._error("stream_in_progress", message)]
        body = envelope.request
        if "stream" not in body:  # validated streaming: no copy of the request after
            body = {**body, "stream": True}
        try:
            request = ChatRequest.model_validate(body)
        except ValidationError as exc:
            error = validation_error(exc, body)
            param = f"request.{error.param}" if error.param else "request"
            return [self._error("invalid_request", error.message, param=param)]
        if not request.stream:
            message = "stream: the realtime surface always streams; omit stream or set it to true"
            return [self._error("invalid_request", message, param="request.stream")]
        # HTTP's ways to read a stream later: a turn is read on its socket, or not at all.
        for param, asked in (
            ("background", request.background),
            ("stream_options.resumable", request.resumable),
        ):
            if asked:
                message = f"{param}: a turn streams to its socket alone; send it over HTTP"
                return [self._error("invalid_request", message, param=f"request.{param}")]
        if self._pending:
            request = attach(request, [to_part(p) for p in self._pending])
        self.streaming = True
        return [StartTurn(request)]

    def start_accepted(self) -> None:
        """The engine took the turn's request: its pending input is used up."""
        self._strikes = 0
        self.close()

    def close(self) -> None:
        """Let the pending input go (used up, or the connection closed)."""
        if self._ledger is not None and self._pending_bytes:
            self._ledger.give(self._owner, self._pending_bytes)
        self._pending = []
        self._pending_bytes = 0

    def start_refused(self) -> None:
        """The engine refused the request (unknown model, unsupported input): keep the input."""
        self.streaming = False

    def _take(self, b64: str, *, new_item: bool, samples: bool = False) -> bytes | Send:
        """Decode one chunk of input and count it against the pending limits. ``samples``:
        16-bit samples, joined to the chunk before (half of one would shift the rest)."""
        try:
            decoded = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            return self._error("invalid_envelope", "b64: not valid base64", param="b64")
        if samples and len(decoded) % 2:
            message = "b64: pcm16 audio is 16-bit samples, an even number of bytes"
            return self._error("invalid_envelope", message, param="b64")
        refused = self._count(len(decoded), new_item=new_item)
        return decoded if refused is None else refused

    def _count(self, size: int, *, new_item: bool = False) -> Send | None:
        """Count ``size`` bytes (and, for a new item, what an item costs) against the
        pending limits; the refusal, if over one."""
        if new_item:
            if len(self._pending) >= self.max_json_items // 4:  # each is a part of ~4 values
                message = (
                    f"pending input would be more than {self.max_json_items // 4} items "
                    "([limits] max_json_items / 4); this chunk was dropped, the earlier input "
                    "is kept"
                )
                return self._error("input_too_large", message)
            size += PENDING_ITEM_BYTES
        total = self._pending_bytes + size
        if total > self.max_pending_input_bytes:
            message = (
                f"pending input would be {total} bytes, over the limit of "
                f"{self.max_pending_input_bytes}; this chunk was dropped, the earlier input is kept"
            )
            return self._error("input_too_large", message)
        ledger = self._ledger
        if ledger is not None and not ledger.take(self._owner, size):
            message = (
                f"the key's connections hold {ledger.held(self._owner)} bytes of pending input, "
                f"the limit is {ledger.limit} ([realtime] max_pending_bytes_per_key); this chunk "
                "was dropped, the earlier input is kept"
            )
            return self._error("input_too_large", message)
        self._pending_bytes = total
        return None

    def _add_audio(self, envelope: AudioChunkEnvelope) -> list[Action]:
        last = self._pending[-1] if self._pending else None
        merged = (
            envelope.format == "pcm16"
            and isinstance(last, PendingAudio)
            and last.format == "pcm16"
            and last.sample_rate == envelope.sample_rate
        )
        pcm16 = envelope.format == "pcm16"
        decoded = self._take(envelope.b64, new_item=not merged, samples=pcm16)
        if isinstance(decoded, Send):
            return [decoded]
        if merged:
            last.data += decoded  # type: ignore[union-attr]
        else:
            self._pending.append(
                PendingAudio(envelope.format, envelope.sample_rate, bytearray(decoded))
            )
        return []

    def _add_image(self, envelope: ImageEnvelope) -> list[Action]:
        if (envelope.b64 is None) == (envelope.url is None):
            return [self._error("invalid_envelope", "image: give exactly one of b64 and url")]
        url = envelope.url or f"data:{envelope.mime_type};base64,{envelope.b64}"
        header, comma, data = url.partition(",")
        if url.startswith("data:"):
            if not comma:
                return [self._error("invalid_envelope", "url: a data URL needs a ','")]
            if header.endswith(";base64"):
                try:
                    base64.b64decode(data, validate=True)
                except (binascii.Error, ValueError):
                    return [self._error("invalid_envelope", "b64: not valid base64", param="b64")]
        # Held as its URL, inline data or not: that is what it costs until the start.
        refused = self._count(len(url), new_item=True)
        if refused is not None:
            return [refused]
        self._pending.append(
            ImagePart.model_validate({"type": "image_url", "image_url": {"url": url}})
        )
        return []

"""The realtime WebSocket's client envelopes read, and its error frames. Sans-I/O.

A frame is read as far as its ``type`` first (:func:`kind_of`: the rest skipped, built into
nothing); a ``start``'s request is parsed once the route took a token of the key's rate
(:class:`Decoded`); any other envelope holds scalars alone and is read so
(:func:`flat_fields`), one that nests refused unbuilt (:func:`nested_error`). Every error
frame that refuses a frame names its envelope type (``refused``: :func:`error_frame`); a
turn's own end has none (:func:`gateway_error_frame` without ``refused``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import orjson
from pydantic import Field, TypeAdapter, ValidationError

from ..errors import GatewayError
from ..events import Error
from ..request import StrictModel
from .openai_chat import validation_error

__all__ = [
    "ENVELOPE",
    "FRAME",
    "KINDS",
    "AbortEnvelope",
    "AudioChunkEnvelope",
    "Decoded",
    "ImageEnvelope",
    "Send",
    "StartEnvelope",
    "envelope_error",
    "error_frame",
    "flat_fields",
    "gateway_error_frame",
    "kind_of",
    "nested_error",
]


class StartEnvelope(StrictModel):
    type: Literal["start"]
    request: dict[str, Any]


class AbortEnvelope(StrictModel):
    type: Literal["abort"]


class AudioChunkEnvelope(StrictModel):
    type: Literal["audio_chunk"]
    format: Literal["pcm16", "wav", "mp3"]
    b64: str
    sample_rate: int = Field(default=24000, gt=0, le=384_000)


class ImageEnvelope(StrictModel):
    type: Literal["image"]
    mime_type: str = Field(pattern=r"^image/[A-Za-z0-9.+\-]+$")
    b64: str | None = None
    url: str | None = Field(default=None, pattern=r"^(https?://|data:)[\x21-\x7e]+$")
    """Printable ASCII, as URLs are (percent-encoded): a pending image counts as its length,
    which other characters would hold several times over in memory."""


Envelope = Annotated[
    StartEnvelope | AbortEnvelope | AudioChunkEnvelope | ImageEnvelope,
    Field(discriminator="type"),
]
ENVELOPE: TypeAdapter[Any] = TypeAdapter(Envelope)


@dataclass(frozen=True, slots=True)
class Send:
    frame: str  # a text frame for the client
    code: str | None = None  # an error frame's code


@dataclass(frozen=True, slots=True)
class Decoded:
    """A text frame that is a JSON object, before it is validated: a ``start``'s text (not
    yet parsed: the route takes a rate token first), any other envelope's fields, flat."""

    data: dict[str, Any] | None
    text: str = ""

    @property
    def start(self) -> bool:
        """It asks for a turn (valid or not): the route takes a rate token first."""
        return self.data is None

    @property
    def model(self) -> str | None:
        """The model a start names, read without the rest of it: what its refusal (its
        key's rate, an invalid request) is counted under."""
        try:
            request = _asked(self.text).request
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return None
        model = request.model if request is not None else None
        return model if type(model) is str else None


class _Model(msgspec.Struct):
    model: Any = None


class _Asked(msgspec.Struct):
    request: _Model | None = None


_asked = msgspec.json.Decoder(_Asked).decode


class _Kind(msgspec.Struct):
    type: Any = None


kind_of = msgspec.json.Decoder(_Kind).decode
flat_fields = msgspec.json.Decoder(dict[str, str | int | float | bool | None]).decode
"""Any envelope but a start holds scalars alone: read so, one that nests is refused at
its first object or array, built into nothing (orjson built ~50,000 small objects of a
400 KB frame in ~10 ms of the shared loop, and such frames take no rate token)."""


FRAME = "frame"
"""``refused`` of an error frame that answers a frame of no envelope type the session
could read (not JSON, not an object, no or an unknown ``type``, a binary frame)."""


def error_frame(
    code: str,
    message: str,
    *,
    param: str | None = None,
    error_type: str = "invalid_request_error",
    request_id: str | None = None,
    refused: str = FRAME,
) -> Send:
    """An error frame refusing a frame the client sent: the error event's JSON, with the
    connection's request id and ``refused``, the envelope type of the frame refused
    (:data:`FRAME` when it had none that the session could read)."""
    event = Error(error_type=error_type, message=message, code=code, param=param)
    return Send(orjson.dumps({**event.to_dict(request_id), "refused": refused}).decode(), code)


def gateway_error_frame(
    error: GatewayError, request_id: str | None = None, refused: str | None = None
) -> Send:
    """The error frame of a gateway error: a refused frame's (``refused``, as in
    :func:`error_frame`), or a turn's end (None). One that HTTP answers with
    ``Retry-After`` (``rate_limited``, ``too_many_streams``) carries it as
    ``error.retry_after_s``: the whole seconds to wait before the next ``start``."""
    body = error.to_event().to_dict(request_id)
    retry_after = error.headers.get("Retry-After")
    if retry_after is not None and retry_after.isdigit():
        body["error"]["retry_after_s"] = int(retry_after)
    if refused is not None:
        body["refused"] = refused
        param = body["error"].get("param")
        if refused == "start" and param and not param.startswith("request"):
            body["error"]["param"] = f"request.{param}"  # a start's fields are its request's
    return Send(orjson.dumps(body).decode(), error.code)


def nested_error(kind: object, text: str, request_id: str | None) -> Send:
    """The error for an envelope other than a start that holds an object or an array."""
    if kind not in KINDS:
        return _kind_error(kind, request_id)
    fields = _raw_fields(text)  # scanned, not built: the first that nests is named
    field = next((name for name, raw in fields.items() if bytes(raw)[:1] in (b"{", b"[")), None)
    message = f"{kind}: {field}: only a start's request may hold objects or arrays"
    if field is None:  # (a number msgspec cannot hold)
        message = f"{kind}: a field's value is out of range"
    return error_frame(
        "invalid_envelope", message, param=field, request_id=request_id, refused=str(kind)
    )


KINDS = ("start", "abort", "audio_chunk", "image")
_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def _kind_error(kind: object, request_id: str | None) -> Send:
    if kind is None:
        message = "an envelope needs a 'type'"
    else:
        shown = repr(kind) if len(repr(kind)) <= 40 else repr(kind)[:40] + "..."
        message = f"unknown envelope type {shown}; expected start, abort, audio_chunk or image"
    return error_frame("invalid_envelope", message, param="type", request_id=request_id)


def envelope_error(exc: ValidationError, data: dict[str, Any], request_id: str | None) -> Send:
    kind = data.get("type")
    if exc.errors(include_url=False)[0]["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return _kind_error(kind, request_id)
    error = validation_error(exc, data)
    message, param = f"{kind}: {error.message}", error.param
    return error_frame(
        "invalid_envelope", message, param=param, request_id=request_id, refused=str(kind)
    )

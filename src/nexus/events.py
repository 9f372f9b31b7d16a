"""Typed stream events: what providers produce and encoders turn into bytes.

One frozen, slotted record per event type. They are built once per token, so
they carry no validation; the ``type`` tag is a class variable (no per-instance
cost) and encoders dispatch on the class with ``match``.

``to_dict()`` gives the event's JSON form, which *is* the NDJSON line, the
native SSE ``data:`` payload and the WebSocket text frame::

    {"type":"delta","delta":{"content":"Hello"}}
    {"type":"delta","delta":{},"finish_reason":"stop"}
    {"type":"reasoning","delta":{"reasoning":"Let me think..."}}
    {"type":"tool_call","delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",
        "function":{"name":"f","arguments":""}}]}}
    {"type":"audio","audio":{"data":"<b64>","format":"pcm16","transcript":null}}
    {"type":"image","image":{"data":"<b64>","url":null,"mime_type":"image/png"}}
    {"type":"citation","citation":{"url":"...","title":"...","quoted":"..."}}
    {"type":"usage","usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}
    {"type":"usage","usage":{"prompt_tokens":41,"completion_tokens":0,"total_tokens":41},"partial":true}
    {"type":"error","error":{"type":"upstream_error","message":"...","code":"...","retryable":true,
        "request_id":"req_..."}}
    {"type":"heartbeat"}
    {"type":"done"}

End of stream is not an event that consumers receive: iteration simply ends
(see :mod:`nexus.stream`). :class:`Done` exists for the formats that write an
explicit terminator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "Audio",
    "Citation",
    "Delta",
    "Done",
    "Error",
    "Heartbeat",
    "Image",
    "Reasoning",
    "StreamEvent",
    "ToolCall",
    "Usage",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One fragment of a tool call.

    The first fragment for an ``index`` carries ``id`` and ``name``; later
    fragments carry only more ``arguments`` text, to be concatenated.
    """

    type: ClassVar[str] = "tool_call"
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def wire(self) -> dict[str, Any]:
        """The OpenAI ``delta.tool_calls[]`` entry for this fragment."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"type": "tool_call", "delta": {"tool_calls": [self.wire()]}}


@dataclass(frozen=True, slots=True)
class Delta:
    """An increment of the assistant message; ``finish_reason`` closes the turn."""

    type: ClassVar[str] = "delta"
    content: str | None = None
    role: str | None = None
    refusal: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    finish_reason: str | None = None

    def delta_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.role is not None:
            out["role"] = self.role
        if self.content is not None:
            out["content"] = self.content
        if self.refusal is not None:
            out["refusal"] = self.refusal
        if self.tool_calls:
            out["tool_calls"] = [tc.wire() for tc in self.tool_calls]
        return out

    def to_dict(self) -> dict[str, Any]:
        if self.finish_reason is None:
            return {"type": "delta", "delta": self.delta_dict()}
        return {"type": "delta", "delta": self.delta_dict(), "finish_reason": self.finish_reason}


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Reasoning ("thinking") text, kept apart from the answer.

    ``signature`` is the provider's seal over the reasoning so far (Anthropic's
    ``signature_delta``), which a client must send back with the thinking block
    in a later turn; it usually arrives alone, with empty ``text``.
    """

    type: ClassVar[str] = "reasoning"
    text: str
    signature: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.signature is None:
            return {"type": "reasoning", "delta": {"reasoning": self.text}}
        return {"type": "reasoning", "delta": {"reasoning": self.text, "signature": self.signature}}


@dataclass(frozen=True, slots=True)
class Audio:
    """A chunk of audio output: base64 ``data`` and/or its ``transcript``."""

    type: ClassVar[str] = "audio"
    data: str | None = None
    format: str | None = None
    transcript: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "audio",
            "audio": {"data": self.data, "format": self.format, "transcript": self.transcript},
        }


@dataclass(frozen=True, slots=True)
class Image:
    """An image output, inline (base64 ``data``) or by ``url``."""

    type: ClassVar[str] = "image"
    data: str | None = None
    url: str | None = None
    mime_type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "image",
            "image": {"data": self.data, "url": self.url, "mime_type": self.mime_type},
        }


@dataclass(frozen=True, slots=True)
class Citation:
    """A source the answer cites."""

    type: ClassVar[str] = "citation"
    url: str | None = None
    title: str | None = None
    quoted: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "citation",
            "citation": {"url": self.url, "title": self.title, "quoted": self.quoted},
        }


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts; the last usage event of a stream holds the totals.

    ``partial``: the input counts an upstream reported before any output (Anthropic's
    ``message_start``), sent ahead of the first content so that formats which report
    input tokens up front (Anthropic's own ``message_start``) can; ``completion_tokens``
    is 0 and the totals follow at the end. Formats that report only totals skip it
    (OpenAI's usage chunk, the Responses usage); Nexus's own formats write it with
    ``"partial": true``. A consumer that wants the totals takes the last usage event
    that is not partial.
    """

    type: ClassVar[str] = "usage"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None
    partial: bool = False
    cost_usd: float | None = None
    """What these tokens cost, when the gateway has a price for the model that answered
    (:mod:`nexus.pricing`; the engine sets it). Not part of :meth:`wire`: a client gets
    it as ``usage.cost`` when it asks (``stream_options.include_cost``)."""

    def wire(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object (without the cost)."""
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.cache_write_tokens:
            details = out.setdefault("prompt_tokens_details", {})
            details["cache_write_tokens"] = self.cache_write_tokens
        if self.reasoning_tokens is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return out

    def to_dict(self) -> dict[str, Any]:
        if self.partial:
            return {"type": "usage", "usage": self.wire(), "partial": True}
        return {"type": "usage", "usage": self.wire()}


@dataclass(frozen=True, slots=True)
class Error:
    """A failure after the stream started; the stream ends after it.

    ``type`` names the error class (the ``error.type`` of the OpenAI shape),
    ``code`` the specific cause, ``retryable`` whether the same request may
    succeed if sent again. The request id is not in the event: one stream's log
    serves several requests (joins, attaches), and each client's error frame
    carries its own request's id (see :meth:`to_dict`).
    """

    type: ClassVar[str] = "error"
    error_type: str
    message: str
    code: str | None = None
    retryable: bool = False
    param: str | None = None

    def to_dict(self, request_id: str | None = None) -> dict[str, Any]:
        """The event's JSON; with ``request_id`` (the ``X-Request-Id`` of the response it
        is written to) as ``error.request_id``."""
        error: dict[str, Any] = {
            "type": self.error_type,
            "message": self.message,
            "code": self.code,
            "retryable": self.retryable,
        }
        if self.param is not None:
            error["param"] = self.param
        if request_id is not None:
            error["request_id"] = request_id
        return {"type": "error", "error": error}


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Idle keepalive, written by the pump, never by providers."""

    type: ClassVar[str] = "heartbeat"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "heartbeat"}


@dataclass(frozen=True, slots=True)
class Done:
    """The terminator of formats that have one; ``aborted`` after a client abort."""

    type: ClassVar[str] = "done"
    aborted: bool = False

    def to_dict(self) -> dict[str, Any]:
        if self.aborted:
            return {"type": "done", "aborted": True}
        return {"type": "done"}


StreamEvent = (
    Delta | Reasoning | ToolCall | Audio | Image | Citation | Usage | Error | Heartbeat | Done
)


def plain_content(event: object) -> str | None:
    """The text of a delta that carries only content (the commonest event), else None.

    An encoder may frame it with bytes made once, around one ``dumps`` of the text.
    """
    if type(event) is Delta:
        content = event.content
        if (
            content is not None
            and event.finish_reason is None
            and event.tool_calls is None
            and event.role is None
            and event.refusal is None
        ):
            return content
    return None

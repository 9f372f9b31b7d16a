"""Typed stream events: what providers produce and encoders turn into bytes.

Frozen, slotted records, built once per token, so without validation; the
``type`` tag is a class variable and encoders dispatch with ``match``.
``to_dict()`` is the event's JSON: the NDJSON line, the native SSE ``data:``
and the WebSocket text frame, e.g. ``{"type":"delta","delta":{"content":"Hi"}}``
or ``{"type":"usage","usage":{...},"partial":true}`` (docs/protocols.md).
End of stream is not an event consumers receive: iteration ends
(:mod:`nexus.stream`); :class:`Done` is for formats with a terminator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "MAX_TOKENS",
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
    """One fragment of a tool call: the first for an ``index`` carries ``id`` and
    ``name``, later ones more ``arguments`` text, to be concatenated. ``extra_content``:
    what a compatible server attached to the call for its next turn (Gemini's
    ``{"google": {"thought_signature": ...}}``, which it needs back, or it refuses)."""

    type: ClassVar[str] = "tool_call"
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    extra_content: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """The OpenAI ``delta.tool_calls[]`` entry for this fragment."""
        out: dict[str, Any] = {"index": self.index}
        if self.extra_content is not None:
            out["extra_content"] = self.extra_content
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
    """An increment of the assistant message; ``finish_reason`` closes the turn.

    ``stop_sequence``: beside ``finish_reason="stop"``, the stop sequence that ended the
    turn, when the provider says which (Anthropic does, OpenAI does not); Anthropic's
    format reports it as ``stop_reason: "stop_sequence"``.

    ``stop_reason``: beside a finish reason, Anthropic's own where ours says less
    (``model_context_window_exceeded`` and ``pause_turn``, our ``length`` and ``stop``):
    Anthropic's format reports it as it came, since its clients act on it.
    """

    type: ClassVar[str] = "delta"
    content: str | None = None
    role: str | None = None
    refusal: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    finish_reason: str | None = None
    stop_sequence: str | None = None
    stop_reason: str | None = None

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
        out = {"type": "delta", "delta": self.delta_dict(), "finish_reason": self.finish_reason}
        if self.stop_sequence is not None:
            out["stop_sequence"] = self.stop_sequence
        return out


_new = object.__new__
_set_content, _set_role, _set_refusal, _set_tool_calls, _set_finish_reason, _set_stop = (
    Delta.__dict__[name].__set__
    for name in ("content", "role", "refusal", "tool_calls", "finish_reason", "stop_sequence")
)
_set_stop_reason = Delta.__dict__["stop_reason"].__set__


_SHARED: dict[str, Delta] = {}
SHARED_MAX = 4096
"""Most content deltas :func:`content_delta` keeps for reuse (the table is emptied when full)."""
SHARED_LEN = 24
"""Longest text (characters) whose delta is kept for reuse: a token, not a paragraph."""


def content_delta(content: str) -> Delta:
    """``Delta(content)``, the commonest event (one per token), equal in every way.

    Short texts get one shared delta per text: an event is immutable, and a stream's log
    holds every event it had, so a token repeated across streams (real text is mostly
    common words) costs a list slot, not an object and a string (~130 bytes per token
    held, ~7 KB per idle stream of 60 tokens). A new one is made for half the cost of
    ``Delta(content)``: the frozen dataclass's ``__init__`` sets each field with
    ``object.__setattr__``; this sets the slots through their descriptors.
    """
    delta = _SHARED.get(content)
    if delta is not None:
        return delta
    delta = _new(Delta)
    _set_content(delta, content)
    _set_role(delta, None)
    _set_refusal(delta, None)
    _set_tool_calls(delta, None)
    _set_finish_reason(delta, None)
    _set_stop(delta, None)
    _set_stop_reason(delta, None)
    if len(content) <= SHARED_LEN:
        if len(_SHARED) >= SHARED_MAX:
            _SHARED.clear()
        _SHARED[content] = delta
    return delta


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Reasoning ("thinking") text, kept apart from the answer. ``signature``: the
    provider's seal over it (Anthropic's ``signature_delta``, sent back in a later
    turn), usually alone, with empty ``text``; it ends its block: reasoning after it is
    another block. ``redacted``: a block of its own whose thinking the provider encrypted
    (Anthropic's ``redacted_thinking`` ``data``), with empty ``text``: opaque, it goes back
    unmodified in a later turn."""

    type: ClassVar[str] = "reasoning"
    text: str
    signature: str | None = None
    redacted: str | None = None

    def to_dict(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"reasoning": self.text}
        if self.signature is not None:
            delta["signature"] = self.signature
        if self.redacted is not None:
            delta["redacted"] = self.redacted
        return {"type": "reasoning", "delta": delta}


@dataclass(frozen=True, slots=True)
class Audio:
    """A piece of audio output: base64 ``data`` and/or a piece of its ``transcript``.

    ``id``: the upstream's name for the whole audio answer (OpenAI's ``audio_...``), on
    the piece that carried it; a client sends it back in the next turn's assistant
    message (``audio: {"id": ...}``) instead of the audio itself. ``expires_at``: when
    the upstream forgets it (Unix seconds), on the piece that said so."""

    type: ClassVar[str] = "audio"
    data: str | None = None
    format: str | None = None
    transcript: str | None = None
    id: str | None = None
    expires_at: int | None = None

    def wire(self) -> dict[str, Any]:
        """OpenAI's ``delta.audio``: the fields this piece carries, no nulls."""
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
        if self.data is not None:
            out["data"] = self.data
        if self.format is not None:
            out["format"] = self.format
        if self.transcript is not None:
            out["transcript"] = self.transcript
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at
        return out

    def to_dict(self) -> dict[str, Any]:
        audio: dict[str, Any] = {
            "data": self.data,
            "format": self.format,
            "transcript": self.transcript,
        }
        if self.id is not None:
            audio["id"] = self.id
        if self.expires_at is not None:
            audio["expires_at"] = self.expires_at
        return {"type": "audio", "audio": audio}


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
    source: dict[str, Any] | None = None
    """The citation as an Anthropic upstream sent it (a document's ``char_location``,
    ``page_location``...: where in which document; a search result's ``encrypted_index``),
    for ``/v1/messages`` clients, who get it as it came."""

    def to_dict(self) -> dict[str, Any]:
        citation: dict[str, Any] = {"url": self.url, "title": self.title, "quoted": self.quoted}
        if self.source is not None:
            citation["source"] = self.source
        return {"type": "citation", "citation": citation}


MAX_TOKENS = 10**9
"""The most tokens one count of a :class:`Usage` holds: a thousand times the largest
context window, and small enough that any count times any price is a finite cost. The
upstream decoders refuse counts past it (``upstream_protocol_error``)."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts; the last usage event that is not ``partial`` holds the totals.

    ``partial``: input counts an upstream reported before any output (Anthropic's
    ``message_start``), ``completion_tokens`` 0. Formats that report input up front
    write them; those that report only totals skip them; Nexus's own formats mark
    them ``"partial": true``.

    The details (each None when the upstream did not report it) are parts of the two
    counts, as OpenAI breaks them down: they go to OpenAI-format clients as the upstream
    sent them (a client of OpenAI's reads them), and absent stays absent.
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
    """What they cost (:mod:`nexus.pricing`), when priced; not in :meth:`wire` (a client
    asks for it with ``stream_options.include_cost``)."""
    prompt_audio_tokens: int | None = None
    """Of ``prompt_tokens``, those of audio input (OpenAI's ``prompt_tokens_details``);
    billed at the audio input price when the model's :class:`~nexus.pricing.Price` has one."""
    completion_audio_tokens: int | None = None
    """Of ``completion_tokens``, those of audio output, counted within them as OpenAI
    counts them (``completion_tokens_details``); billed at the audio output price when the
    model's :class:`~nexus.pricing.Price` has one."""
    accepted_prediction_tokens: int | None = None
    """Of ``completion_tokens``, those of a predicted output that appeared in the answer."""
    rejected_prediction_tokens: int | None = None
    """Those of a predicted output that did not: billed as completion tokens, and counted
    within them (OpenAI's word)."""
    prompt_text_tokens: int | None = None
    prompt_image_tokens: int | None = None
    completion_text_tokens: int | None = None
    cache_write_1h_tokens: int | None = None
    """Of ``cache_write_tokens``, those written for an hour (Anthropic's
    ``ephemeral_1h_input_tokens``), billed at their own price."""

    def wire(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object (without the cost): the counts, and the details the
        upstream reported, in the order OpenAI writes them."""
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        prompt: dict[str, int] = {}
        if self.cached_tokens is not None:
            prompt["cached_tokens"] = self.cached_tokens
        if self.cache_write_tokens:
            prompt["cache_write_tokens"] = self.cache_write_tokens
        if self.prompt_audio_tokens is not None:
            prompt["audio_tokens"] = self.prompt_audio_tokens
        if self.prompt_text_tokens is not None:
            prompt["text_tokens"] = self.prompt_text_tokens
        if self.prompt_image_tokens is not None:
            prompt["image_tokens"] = self.prompt_image_tokens
        if prompt:
            out["prompt_tokens_details"] = prompt
        completion: dict[str, int] = {}
        if self.reasoning_tokens is not None:
            completion["reasoning_tokens"] = self.reasoning_tokens
        if self.completion_audio_tokens is not None:
            completion["audio_tokens"] = self.completion_audio_tokens
        if self.accepted_prediction_tokens is not None:
            completion["accepted_prediction_tokens"] = self.accepted_prediction_tokens
        if self.rejected_prediction_tokens is not None:
            completion["rejected_prediction_tokens"] = self.rejected_prediction_tokens
        if self.completion_text_tokens is not None:
            completion["text_tokens"] = self.completion_text_tokens
        if completion:
            out["completion_tokens_details"] = completion
        return out

    def to_dict(self) -> dict[str, Any]:
        if self.partial:
            return {"type": "usage", "usage": self.wire(), "partial": True}
        return {"type": "usage", "usage": self.wire()}


@dataclass(frozen=True, slots=True)
class Error:
    """A failure after the stream started; the stream ends after it.

    ``error_type`` is the OpenAI shape's ``error.type``, ``code`` the cause,
    ``retryable`` whether the same request may succeed again. No request id: one
    log serves several requests, and each error frame carries its own (:meth:`to_dict`).
    """

    type: ClassVar[str] = "error"
    error_type: str
    message: str
    code: str | None = None
    retryable: bool = False
    param: str | None = None

    def to_dict(self, request_id: str | None = None) -> dict[str, Any]:
        """The event's JSON, with the response's ``X-Request-Id`` as ``error.request_id``."""
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
    """The text of a delta that carries only content (the commonest event), else None:
    an encoder may frame it with bytes made once, around one ``dumps`` of the text."""
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

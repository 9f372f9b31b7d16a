"""OpenAI ``chat.completion.chunk`` SSE (docs/protocols.md §2): the default format.

Each chunk is ``data: {json}\\n\\n`` with no ``event:`` line. The role goes out
once, in the first chunk (the SDK's stream helper concatenates repeated roles);
reasoning is ``delta.reasoning_content``; usage is a trailing chunk with
``choices: []``, only when the request set ``stream_options.include_usage``
(with ``cost``, in USD, when it also set ``include_cost`` and the model has a
price), and only with the totals (an early partial count is not written). A
mid-stream failure is ``event: error`` whose data is ``{"error": {"message",
"type", "param", "code", "retryable", "request_id"}}`` (the SDK raises
``APIError`` on it, with that object as its ``body``), then ``data: [DONE]``.

With ``stream_options.include_obfuscation: true`` every chunk ends with an
``"obfuscation"`` string of random base64url characters, 1 to 16 of them, as
OpenAI pads its chunks against length side channels; otherwise there is none.

The chunk's fixed head (id, object, created, model) is serialised once per
stream; each event serialises only its choice.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from typing import Any

import orjson

from ..events import (
    Audio,
    Citation,
    Delta,
    Error,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
    plain_content,
)
from ..protocol.openai_chat import chunk_prefix
from ..types import StreamMeta
from .base import Encoder

__all__ = ["OpenAISSEEncoder"]

_dumps = orjson.dumps
_CONTENT_OPEN = b'[{"index":0,"delta":{"content":'
_CONTENT_CLOSE = b'},"finish_reason":null}]'


class OpenAISSEEncoder(Encoder):
    media_type = "text/event-stream"
    content_type = "text/event-stream; charset=utf-8"
    aliases = ("sse", "openai")

    def __init__(self, meta: StreamMeta) -> None:
        super().__init__(meta)
        self._head = b"data: " + chunk_prefix(meta)  # the chunk up to its choices
        self._content_head = self._head + _CONTENT_OPEN
        self._obfuscated = meta.include_obfuscation
        # The content chunk's end, unless each one ends with its own obfuscation.
        self._content_end = None if self._obfuscated else _CONTENT_CLOSE + b"}\n\n"
        # Tool calls' first fragments without arguments, held by index until theirs come
        # (see _calls), and the indices seen; made with the first call.
        self._held: dict[int, dict[str, Any]] | None = None
        self._seen: set[int] = set()
        self._listed: dict[str, int] | None = None  # list entries sent, by the delta's key

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return self._head + b"[" + _dumps(choice) + b"]" + self._tail()

    def _tail(self) -> bytes:
        """The end of a chunk: with its random ``obfuscation`` when the client asked."""
        if not self._obfuscated:
            return b"}\n\n"
        raw = os.urandom(13)
        padding = base64.urlsafe_b64encode(raw)[: 1 + raw[-1] % 16]  # no "=" in 17
        return b',"obfuscation":"' + padding + b'"}\n\n'

    def start(self) -> bytes:
        # The retry field rides on the first data frame: a frame holding only
        # ``retry:`` makes the openai SDK parse an empty payload (§1, deviations).
        first = self._chunk({"role": "assistant", "content": ""})
        if self.meta.retry_ms is not None:
            return b"retry: %d\n" % self.meta.retry_ms + first
        return first

    def encode(self, event: StreamEvent) -> bytes:
        content = plain_content(event)
        if content is not None:  # the commonest chunk, around one dumps() of the text
            if (end := self._content_end) is not None:
                return self._content_head + _dumps(content) + end
            return self._content_head + _dumps(content) + _CONTENT_CLOSE + self._tail()
        match event:
            case Delta(content=content, role=None, refusal=None, tool_calls=None):
                delta = {} if content is None else {"content": content}
                return self._filled(event) + self._chunk(delta, event.finish_reason)
            case Delta():
                fields: dict[str, Any] = event.delta_dict()
                fields.pop("role", None)
                if event.tool_calls:
                    fields["tool_calls"] = self._calls(event.tool_calls)
                    if not fields["tool_calls"]:
                        del fields["tool_calls"]
                if filled := self._filled(event):  # after this delta's own calls
                    out = self._chunk(fields) if fields else b""
                    return out + filled + self._chunk({}, event.finish_reason)
                if event.tool_calls and not fields and event.finish_reason is None:
                    return b""  # (a call's first fragment, held)
                return self._chunk(fields, event.finish_reason)
            case Reasoning(text=text):
                # A bare signature has no place in a chat chunk.
                return self._chunk({"reasoning_content": text}) if text else b""
            case ToolCall():
                calls = self._calls((event,))
                return self._chunk({"tool_calls": calls}) if calls else b""
            case Usage():
                if not self.meta.include_usage or event.partial:
                    return b""  # one usage chunk, with the totals
                usage = event.wire()
                if self.meta.include_cost and event.cost_usd is not None:
                    # OpenRouter's field, USD: what this request was charged
                    usage["cost"] = 0.0 if self.meta.joined else event.cost_usd
                return self._head + b'[],"usage":' + _dumps(usage) + self._tail()
            case Audio():
                return self._chunk({"audio": event.wire()})  # as OpenAI streams it
            case Image():
                url = event.url or f"data:{event.mime_type or 'image/png'};base64,{event.data}"
                return self._entry("images", {"type": "image_url", "image_url": {"url": url}})
            case Citation():
                citation = {"url": event.url, "title": event.title}
                if event.quoted is not None:
                    citation["quoted"] = event.quoted
                return self._entry(
                    "annotations", {"type": "url_citation", "url_citation": citation}
                )
            case _:
                return b""

    def _entry(self, key: str, entry: dict[str, Any]) -> bytes:
        """One more entry of a list in the delta (``images``, ``annotations``), numbered: the
        SDK's stream helper adds a second entry to the first by its ``index`` (and raises
        without one)."""
        listed = self._listed
        if listed is None:
            listed = self._listed = {}
        index = listed[key] = listed.get(key, -1) + 1
        return self._chunk({key: [{"index": index, **entry}]})

    def _calls(self, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
        """The fragments to send for ``calls``. A call's first fragment without arguments
        is held until they come, and goes with them; when a later call's arguments come
        first, or the finish, it goes with ``"{}"`` (a tool that takes none: some upstreams
        send ``""``, which is not JSON, and the openai SDK's stream helper ends a call at
        the next index and parses what it holds). Calls whose pieces interleave (every
        first fragment, then the arguments) go out one after another, each whole."""
        out: list[dict[str, Any]] = []
        held, seen = self._held, self._seen
        for call in calls:
            wire = call.wire()
            if call.index not in seen:
                seen.add(call.index)
                if not call.arguments:
                    if held is None:
                        held = self._held = {}
                    held[call.index] = wire
                    continue
            elif not call.arguments and held and call.index in held:
                held[call.index] = _joined(held[call.index], wire)
                continue
            if held:
                for index in sorted(index for index in held if index < call.index):
                    out.append(_joined(held.pop(index), _EMPTY_ARGUMENTS))
                first = held.pop(call.index, None)
                if first is not None:
                    wire = _joined(first, wire)
            out.append(wire)
        return out

    def _filled(self, event: Delta | None) -> bytes:
        """Before the finish (or the end): the calls still held, each with ``"{}"``."""
        held = self._held
        if not held or (event is not None and event.finish_reason is None):
            return b""
        calls = [_joined(held[index], _EMPTY_ARGUMENTS) for index in sorted(held)]
        held.clear()
        return self._chunk({"tool_calls": calls})

    def error(self, event: Error) -> bytes:
        cut = b""
        if self._held:  # calls cut off before their arguments: as they came, then the error
            cut = self._chunk({"tool_calls": [self._held[i] for i in sorted(self._held)]})
            self._held.clear()
        # OpenAI's error object, plus ``retryable`` and the response's ``request_id``
        # (OpenAI's own bodies have neither; the SDK keeps the object as ``APIError.body``).
        error: dict[str, Any] = {
            "message": event.message,
            "type": event.error_type,
            "param": event.param,
            "code": event.code,
            "retryable": event.retryable,
        }
        if self.request_id is not None:
            error["request_id"] = self.request_id
        return cut + b"event: error\ndata: " + _dumps({"error": error}) + b"\n\n"

    def heartbeat(self) -> bytes:
        # A comment line and no blank line: every frame carries an ``id:``, and after
        # one the SDK's decoder dispatches an empty event at each blank line (§1).
        return b": ping\n"

    def end(self) -> bytes:
        return self._filled(None) + b"data: [DONE]\n\n"


_EMPTY_ARGUMENTS = {"function": {"arguments": "{}"}}


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """A call's held first fragment with what came next for it: its arguments, its other
    fields (an ``extra_content``) where the first had none."""
    function = {**first.get("function", {})}
    later = then.get("function", {})
    for key, value in later.items():
        if key == "arguments":
            function[key] = function.get(key, "") + value
        elif value is not None and function.get(key) is None:
            function[key] = value
    joined = {**first, "function": function}
    for key, value in then.items():
        joined.setdefault(key, value)
    return joined

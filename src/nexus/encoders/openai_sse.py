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
        # Tool calls by index: whether no arguments went out for it yet (each such gets
        # "{}" before the finish, as nexus.accumulate gives it); made with the first call.
        self._bare: dict[int, bool] | None = None
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
                ended = b"".join([self._note(call) for call in event.tool_calls or ()])
                delta = event.delta_dict()
                delta.pop("role", None)
                if filled := self._filled(event):  # after this delta's own calls
                    delta_chunk = self._chunk(delta)
                    return ended + delta_chunk + filled + self._chunk({}, event.finish_reason)
                return ended + self._chunk(delta, event.finish_reason)
            case Reasoning(text=text):
                # A bare signature has no place in a chat chunk.
                return self._chunk({"reasoning_content": text}) if text else b""
            case ToolCall():
                return self._note(event) + self._chunk({"tool_calls": [event.wire()]})
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

    def _note(self, call: ToolCall) -> bytes:
        """Notes ``call``'s fragment; the first of a new call ends the calls before it that
        are still without arguments with ``"{}"`` (the openai SDK's stream helper takes a
        new index for the end of the call before it, and parses what that one holds)."""
        bare = self._bare
        if bare is None:
            bare = self._bare = {}
        ended = self._fill(bare) if call.index not in bare else b""
        if call.arguments:
            bare[call.index] = False
        else:  # a call's first fragment (an id repeated on every fragment changes nothing)
            bare.setdefault(call.index, True)
        return ended

    def _filled(self, event: Delta) -> bytes:
        """Before the finish: ``"{}"`` for each call that ended without arguments (some
        upstreams send ``""`` or none for a tool that takes none; "" is not JSON)."""
        bare = self._bare
        if not bare or event.finish_reason is None:
            return b""
        filled = self._fill(bare)
        bare.clear()
        return filled

    def _fill(self, bare: dict[int, bool]) -> bytes:
        """A chunk giving ``"{}"`` to each call in ``bare`` still without arguments."""
        calls = []
        for index, empty in bare.items():
            if empty:
                calls.append({"index": index, "function": {"arguments": "{}"}})
                bare[index] = False
        return self._chunk({"tool_calls": calls}) if calls else b""

    def error(self, event: Error) -> bytes:
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
        return b"event: error\ndata: " + _dumps({"error": error}) + b"\n\n"

    def heartbeat(self) -> bytes:
        # A comment line and no blank line: every frame carries an ``id:``, and after
        # one the SDK's decoder dispatches an empty event at each blank line (§1).
        return b": ping\n"

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"

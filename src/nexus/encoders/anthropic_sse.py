"""Anthropic Messages SSE (docs/protocols.md §3): the default format of ``POST /v1/messages``.

``message_start`` → per content block ``content_block_start`` /
``content_block_delta``* / ``content_block_stop`` → ``message_delta`` (stop
reason, usage) → ``message_stop``. Every frame has its ``event:`` line (the SDK
drops frames without one); heartbeats are ``event: ping``. Reasoning goes in a
``thinking`` block (a signature ends it), redacted reasoning in a ``redacted_thinking``
block sent whole, text in a ``text`` block, each tool call in a ``tool_use``
block sent whole (start, its input in one ``input_json_delta``, stop) once its arguments
make a JSON object, ``{"_raw": ...}`` at the end when they never do, as in the JSON body
(the SDK fails on broken JSON). A
mid-stream failure is an ``event: error`` frame in the non-streaming error shape, and the
stream ends there.

``message_start`` goes out with the first event: an upstream that reports input
tokens before any content (Anthropic's own ``message_start``) gives a partial
:class:`~nexus.events.Usage` first, whose counts it carries (else 0); the
``message_delta`` carries the totals.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..events import (
    Citation,
    Delta,
    Error,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
    plain_content,
)
from ..protocol.anthropic_output import (
    anthropic_error_type,
    citation_body,
    error_body,
    message_id,
    stop_fields,
    tool_input_json,
    usage_body,
)
from ..types import StreamMeta, fallback_call_id
from .base import Encoder

__all__ = ["AnthropicSSEEncoder"]

_dumps = orjson.dumps
_TEXT_DELTA = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":%d,"delta":{"type":"text_delta","text":'
)
_PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_STATUS_BY_CODE = {
    "upstream_timeout": 504,
    "upstream_rate_limited": 429,
    "server_shutting_down": 503,
}


class AnthropicSSEEncoder(Encoder):
    media_type = "application/vnd.nexus.anthropic-messages+sse"
    content_type = "text/event-stream; charset=utf-8"
    aliases = ("anthropic", "messages")

    def __init__(self, meta: StreamMeta) -> None:
        super().__init__(meta)
        self._index = -1  # index of the open content block, -1 when none is open
        self._open: str | None = None  # "text", "thinking" or "signed" (sealed thinking)
        self._text_head: bytes | None = None  # a text block's delta frame, while it is open
        self._tool_blocks: dict[int, int] = {}  # tool-call index -> its block's, once out
        self._calls: dict[int, tuple[list[str | None], list[str]]] = {}
        """Tool calls held back, by index: ([id, name], their input's pieces)."""
        # finish reason, stop sequence, Anthropic's own reason
        self._finish: tuple[str, str | None, str | None] | None = None
        self._refused = False  # a refusal was written: the turn ends with stop_reason refusal
        self._usage: Usage | None = None
        self._failed = False
        self._started = False  # message_start went out
        self._retry = b"retry: %d\n" % meta.retry_ms if meta.retry_ms is not None else b""

    def _frame(self, name: str, **fields: Any) -> bytes:
        """The frame of the event ``name``: its ``event:`` line, and ``type`` first in its data."""
        return b"event: %s\ndata: %s\n\n" % (name.encode(), _dumps({"type": name, **fields}))

    def start(self) -> bytes:
        return b""  # message_start waits for the first event (see the module docstring)

    def _message_start(self, usage: Usage | None) -> bytes:
        """``message_start`` (after the ``retry:`` line), once; ``usage``: the input counts
        reported before any output, if any."""
        if self._started:
            return b""
        self._started = True
        message: dict[str, Any] = {
            "id": message_id(self.meta.id),
            "type": "message",
            "role": "assistant",
            "model": self.meta.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_body(usage),
        }
        return self._first() + self._frame("message_start", message=message)

    def _first(self) -> bytes:
        """The ``retry:`` line, on whichever frame goes out first; then nothing."""
        retry, self._retry = self._retry, b""
        return retry

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = self._text_head = None
        return self._frame("content_block_stop", index=self._index)

    def _tool_blocks_out(self, *, final: bool = False) -> bytes:
        """The held tool calls' blocks, each whole (start, its input in one
        ``input_json_delta``, stop), in their order, as far as each one's pieces make a
        JSON object; at the message's end (``final``) all of them, broken input as
        ``{"_raw": ...}`` as in the JSON body (tool_input_json). The SDK parses each piece
        as it comes and fails on broken JSON, and a client may run a tool at its block's
        stop: neither may see a part, nor do parallel calls whose pieces interleave."""
        out = b""
        for call in sorted(self._calls):
            (call_id, name), pieces = self._calls[call]
            arguments = "".join(pieces)
            partial = tool_input_json(arguments) if arguments else None
            if not final and (partial is None or partial is not arguments):
                break  # not an object yet: more pieces may come; later calls wait
            del self._calls[call]
            out += self._close()
            self._index += 1
            self._tool_blocks[call] = index = self._index
            tool = {
                "type": "tool_use",
                "id": call_id or fallback_call_id(self.meta.id, call),
                "name": name or "",
                "input": {},
            }
            out += self._frame("content_block_start", index=index, content_block=tool)
            if partial is not None:
                delta = {"type": "input_json_delta", "partial_json": partial}
                out += self._delta(index, delta)
            out += self._frame("content_block_stop", index=index)
        return out

    def _open_block(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = kind
        self._text_head = _TEXT_DELTA % self._index if kind == "text" else None
        return out + self._frame("content_block_start", index=self._index, content_block=block)

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return self._frame("content_block_delta", index=index, delta=delta)

    def _in_text(self) -> bytes:
        """A text block opened, unless one is open."""
        if self._open == "text":
            return b""
        return self._open_block("text", {"type": "text", "text": ""})

    def _text(self, text: str) -> bytes:
        return self._in_text() + self._delta(self._index, {"type": "text_delta", "text": text})

    def encode(self, event: StreamEvent) -> bytes:
        head = self._text_head
        if head is not None and (content := plain_content(event)):
            # The commonest frame, around one dumps() of the text.
            return head + _dumps(content) + b"}}\n\n"
        if not self._started:
            early = event if type(event) is Usage and event.partial else None
            return self._message_start(early) + self.encode(event)
        match event:
            case Delta():
                out = b""
                if event.content:
                    out += self._text(event.content)
                if event.refusal:
                    out += self._text(event.refusal)
                    self._refused = True
                for call in event.tool_calls or ():
                    out += self._tool(call)
                if event.finish_reason is not None and self._finish is None:
                    self._finish = (event.finish_reason, event.stop_sequence, event.stop_reason)
                return out
            case Reasoning(text=text, signature=signature, redacted=redacted):
                if redacted is not None:  # a block of its own, whole
                    block = {"type": "redacted_thinking", "data": redacted}
                    return self._open_block("redacted", block) + self._close()
                out = b""
                if self._open != "thinking":
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                    out = self._open_block("thinking", block)
                if text:
                    delta = {"type": "thinking_delta", "thinking": text}
                    out += self._delta(self._index, delta)
                if signature:
                    delta = {"type": "signature_delta", "signature": signature}
                    out += self._delta(self._index, delta)
                    self._open = "signed"  # the block is whole: reasoning after it is another
                return out
            case ToolCall():
                return self._tool(event)
            case Citation():
                out = self._in_text()
                cited = {"type": "citations_delta", "citation": citation_body(event)}
                return out + self._delta(self._index, cited)
            case Usage():
                self._usage = event
                return b""
            case _:
                return b""

    def _tool(self, call: ToolCall) -> bytes:
        block = self._tool_blocks.get(call.index)
        if block is not None:  # more after its block went out whole: as it comes
            if not call.arguments or call.arguments.isspace():
                return b""
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            return self._delta(block, delta)
        held = self._calls.get(call.index)
        if held is None:
            held = self._calls[call.index] = ([call.id, call.name], [])
        else:
            named = held[0]
            named[0], named[1] = named[0] or call.id, named[1] or call.name
        if call.arguments:
            held[1].append(call.arguments)
            if call.arguments.rstrip().endswith("}"):
                return self._tool_blocks_out()
        return b""

    def error(self, event: Error) -> bytes:
        self._failed = True
        # An Anthropic upstream's own type survives; ours map by their status.
        status = _STATUS_BY_CODE.get(
            event.code or "", 400 if event.error_type == "invalid_request_error" else 500
        )
        kind = anthropic_error_type(event.error_type, status)
        body = error_body(kind, event.message, event.code, self.request_id)
        return self._first() + b"event: error\ndata: " + _dumps(body) + b"\n\n"

    def heartbeat(self) -> bytes:
        return self._first() + _PING

    def end(self) -> bytes:
        if self._failed:
            return b""
        out = self._message_start(None) + self._close()
        out += self._tool_blocks_out(final=True)  # calls whose input never made an object
        finish, sequence, native = self._finish or (None, None, None)
        stop = stop_fields(finish, sequence, self._refused, native, bool(self._tool_blocks))
        out += self._frame("message_delta", delta=stop, usage=usage_body(self._usage))
        return out + self._frame("message_stop")

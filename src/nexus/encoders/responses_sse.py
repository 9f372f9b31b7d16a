"""OpenAI Responses API SSE (docs/protocols.md §4): the default format of ``/v1/responses``.

Every frame is ``event: <type>\ndata: {"type": <type>, "sequence_number": N, ...}\n\n``,
``N`` counting from 0 over the stream; no ``[DONE]``. A state machine over
*output items*, one open at a time:

* :meth:`start`: ``response.created``, ``response.in_progress`` (led by whichever
  method runs first, so that numbering follows the byte order).
* Reasoning opens a ``reasoning`` item (one summary part), content a ``message``
  item (an ``output_text`` part; a refusal, a ``refusal`` part), each tool call
  a ``function_call`` item. An item closes (its ``...done`` events, then
  ``output_item.done``) when another starts, and at the end: the SDK wants a
  ``done`` for each. A call whose arguments are not yet whole JSON when the next
  call starts stays open beside it (an upstream may interleave parallel calls'
  pieces) until they are, or an item of another kind starts, or the end: each
  call's ``done`` carries its whole arguments.
* :meth:`end`: ``response.completed`` or ``response.incomplete`` (``length``,
  ``content_filter``) with the full response, built as the non-streaming body
  is (:mod:`nexus.protocol.openai_responses_output`).
* :meth:`error`: a flat ``error`` event (the SDK yields it) with ``code``,
  ``message``, ``param`` and our ``request_id``, then ``response.failed``.
* Usage: the totals, once, in the final response (not an early partial count).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from ..events import Delta, Error, Reasoning, StreamEvent, ToolCall, Usage, plain_content
from ..protocol.openai_responses_output import (
    function_call_item,
    incomplete_reason,
    message_item,
    reasoning_item,
    refusal_part,
    response_ids,
    response_object,
    text_part,
    usage_body,
)
from ..types import StreamMeta, fallback_call_id
from .base import Encoder

__all__ = ["ResponsesSSEEncoder", "final_response"]

_dumps = orjson.dumps
_TEXT_DELTA = "response.output_text.delta"
# The commonest frame, with holes for the sequence number, then (per part) the text.
_TEXT_HEAD = b'event: %s\ndata: {"type":"%s","sequence_number":%%d' % ((_TEXT_DELTA.encode(),) * 2)
_TEXT_TAIL = b',"logprobs":[]}\n\n'


@dataclass(slots=True)
class _Item:
    """One output item as it streams: its place, and its text so far."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    index: int
    call_id: str = ""
    name: str = ""
    chunks: list[str] = field(default_factory=list)  # reasoning text or arguments
    parts: list[tuple[str, list[str]]] = field(default_factory=list)  # message: (type, text)
    status: str = "in_progress"
    filled: bool = False  # closed without arguments, given "{}": pieces that come later replace it

    def snapshot(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.id, "".join(self.chunks))
        if self.kind == "message":
            parts = [_part(kind, "".join(chunks)) for kind, chunks in self.parts]
            return message_item(self.id, parts, self.status)
        return function_call_item(
            self.id, self.call_id, self.name, "".join(self.chunks), self.status
        )


def _part(kind: str, text: str) -> dict[str, Any]:
    return text_part(text) if kind == "output_text" else refusal_part(text)


class ResponsesSSEEncoder(Encoder):
    media_type = "application/vnd.nexus.openai-responses+sse"
    content_type = "text/event-stream; charset=utf-8"
    aliases = ("responses", "openai-responses")

    def __init__(self, meta: StreamMeta) -> None:
        super().__init__(meta)
        self._seq = 0
        self._started = False
        self._finished = False
        self._items: list[_Item] = []
        self._current: _Item | None = None
        self._calls_open: list[_Item] = []  # parallel calls before the current one, open
        # Tool-call items by index and by id; made with the first call (an idle
        # stream's encoder holds as little as it can).
        self._calls: dict[int, _Item] | None = None
        self._call_ids: dict[str, _Item]  # set with _calls
        self._usage: Usage | None = None
        self._finish: str | None = None
        # While the open part is output_text: its delta frame (holes for the sequence
        # number and the text), and its text so far.
        self._text_frame: bytes | None = None
        self._part_text: list[str] = []

    @property
    def _id(self) -> str:
        return response_ids(self.meta.id)[0]

    @property
    def _stem(self) -> str:
        return response_ids(self.meta.id)[1]

    # --- framing -------------------------------------------------------------

    def _event(self, type_: str, fields: dict[str, Any]) -> bytes:
        seq = self._seq
        self._seq = seq + 1
        body = {"type": type_, "sequence_number": seq, **fields}
        return b"event: " + type_.encode() + b"\ndata: " + _dumps(body) + b"\n\n"

    def _response(self, status: str, **kwargs: Any) -> dict[str, Any]:
        return response_object(
            response_id=self._id,
            created_at=self.meta.created,
            model=self.meta.model,
            status=status,
            echo=self.meta.echo,
            **kwargs,
        )

    def _preamble(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        response = self._response("in_progress", output=[])
        frames = self._event("response.created", {"response": response}) + self._event(
            "response.in_progress", {"response": response}
        )
        if self.meta.retry_ms is not None:
            # On the first data frame: a frame of only ``retry:`` makes the SDK parse "" (§1).
            return b"retry: %d\n" % self.meta.retry_ms + frames
        return frames

    # --- the Encoder interface -------------------------------------------------

    def start(self) -> bytes:
        return self._preamble()

    def encode(self, event: StreamEvent) -> bytes:
        frame = self._text_frame
        if frame is not None and (content := plain_content(event)):
            self._part_text.append(content)
            self._seq += 1
            return frame % (self._seq - 1, _dumps(content))
        out = self._preamble()
        match event:
            case Delta():
                if event.content:
                    out += self._text("output_text", event.content)
                if event.refusal:
                    out += self._text("refusal", event.refusal)
                for call in event.tool_calls or ():
                    out += self._tool_call(call)
                if event.finish_reason is not None:
                    self._finish = event.finish_reason
            case Reasoning(text=text) if text:
                out += self._reasoning(text)
            case ToolCall():
                out += self._tool_call(event)
            case Usage():
                if not event.partial:
                    self._usage = event
            case _:
                pass  # audio, images, citations: not in this format yet
        return out

    def error(self, event: Error) -> bytes:
        if self._finished:
            return b""
        self._finished = True
        fields = {"code": event.code, "message": event.message, "param": event.param}
        if self.request_id is not None:
            fields["request_id"] = self.request_id
        out = self._preamble() + self._event("error", fields)
        for item in (*self._calls_open, self._current):
            if item is not None:
                item.status = "incomplete"  # added, never done: cut off by the failure
        response = self._response(
            "failed",
            output=[item.snapshot() for item in self._items],
            usage=None if self._usage is None else usage_body(self._usage),
            # ResponseError.code is a closed set in the SDK's types; ours stays in ``error``.
            error={"code": _failed_code(event), "message": event.message},
        )
        return out + self._event("response.failed", {"response": response})

    def heartbeat(self) -> bytes:
        # A comment line and no blank line: every frame carries an ``id:``, and after
        # one the SDK's decoder dispatches an empty event at each blank line (§1).
        return b": ping\n"

    def end(self) -> bytes:
        if self._finished:
            return b""
        self._finished = True
        reason = incomplete_reason(self._finish)
        out = self._preamble() + self._close("completed" if reason is None else "incomplete")
        response = self._response(
            "completed" if reason is None else "incomplete",
            output=[item.snapshot() for item in self._items],
            usage=usage_body(self._usage),
            incomplete=reason,
        )
        kind = "response.completed" if reason is None else "response.incomplete"
        return out + self._event(kind, {"response": response})

    # --- items -----------------------------------------------------------------

    def _open(
        self, kind: str, prefix: str, call_id: str = "", name: str = ""
    ) -> tuple[bytes, _Item]:
        current = self._current
        if kind == "function_call" and current is not None and current.kind == kind:
            self._calls_open.append(current)  # its pieces may still come, interleaved
            self._current = None
            out = b""
            for call in [c for c in self._calls_open if _whole(c)]:
                self._calls_open.remove(call)
                out += self._close_item(call, "completed")
        else:
            out = self._close("completed")
        index = len(self._items)
        item = _Item(kind, f"{prefix}_{self._stem}_{index}", index, call_id=call_id, name=name)
        self._items.append(item)
        self._current = item
        added = self._event(
            "response.output_item.added", {"output_index": index, "item": _added(item)}
        )
        return out + added, item

    def _close(self, status: str) -> bytes:
        """The ``...done`` events of the open items, if any, each ending with
        ``output_item.done``: parallel calls kept open first (``completed``), then the
        current item (``status``)."""
        out = b""
        for call in self._calls_open:
            out += self._close_item(call, "completed")
        self._calls_open = []
        item = self._current
        if item is None:
            return out
        self._current = None
        self._text_frame = None
        return out + self._close_item(item, status)

    def _close_item(self, item: _Item, status: str) -> bytes:
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            text = "".join(item.chunks)
            out = self._event(
                "response.reasoning_summary_text.done", {**where, "summary_index": 0, "text": text}
            ) + self._event(
                "response.reasoning_summary_part.done",
                {**where, "summary_index": 0, "part": {"type": "summary_text", "text": text}},
            )
        elif item.kind == "message":
            out = self._close_part(item)
        else:
            out = b""
            if not item.chunks:  # a tool without arguments: "{}", as nexus.accumulate has it
                item.chunks.append("{}")
                item.filled = True
                out = self._event(
                    "response.function_call_arguments.delta", {**where, "delta": "{}"}
                )
            out += self._event(
                "response.function_call_arguments.done",
                {**where, "name": item.name, "arguments": "".join(item.chunks)},
            )
        item.status = status
        done = {"output_index": item.index, "item": item.snapshot()}
        return out + self._event("response.output_item.done", done)

    def _reasoning(self, text: str) -> bytes:
        item = self._current
        out = b""
        if item is None or item.kind != "reasoning":
            out, item = self._open("reasoning", "rs")
            out += self._event(
                "response.reasoning_summary_part.added",
                {
                    "item_id": item.id,
                    "output_index": item.index,
                    "summary_index": 0,
                    "part": {"type": "summary_text", "text": ""},
                },
            )
        item.chunks.append(text)
        return out + self._event(
            "response.reasoning_summary_text.delta",
            {"item_id": item.id, "output_index": item.index, "summary_index": 0, "delta": text},
        )

    def _text(self, kind: str, text: str) -> bytes:
        """A content (``output_text``) or refusal delta into the open message item."""
        item = self._current
        out = b""
        if item is None or item.kind != "message":
            out, item = self._open("message", "msg")
        if not item.parts or item.parts[-1][0] != kind:
            out += self._close_part(item)
            self._part_text = []
            item.parts.append((kind, self._part_text))
            out += self._event(
                "response.content_part.added",
                {**_where(item), "part": _part(kind, "")},
            )
            if kind == "output_text":
                where = b',"item_id":%s,"output_index":%d,"content_index":%d,"delta":' % (
                    _dumps(item.id),
                    item.index,
                    len(item.parts) - 1,
                )
                self._text_frame = _TEXT_HEAD + where.replace(b"%", b"%%") + b"%s" + _TEXT_TAIL
        item.parts[-1][1].append(text)
        if kind == "output_text":
            return out + self._event(_TEXT_DELTA, {**_where(item), "delta": text, "logprobs": []})
        return out + self._event("response.refusal.delta", {**_where(item), "delta": text})

    def _close_part(self, item: _Item) -> bytes:
        if not item.parts:
            return b""
        self._text_frame = None
        kind, chunks = item.parts[-1]
        text = "".join(chunks)
        where = _where(item)
        if kind == "output_text":
            done = self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
        else:
            done = self._event("response.refusal.done", {**where, "refusal": text})
        return done + self._event(
            "response.content_part.done", {**where, "part": _part(kind, text)}
        )

    def _tool_call(self, call: ToolCall) -> bytes:
        # Merged as nexus.accumulate merges: by id when one repeats, else by index.
        calls = self._calls
        if calls is None:
            calls = self._calls = {}
            self._call_ids = {}
        item = self._call_ids.get(call.id) if call.id is not None else None
        if item is None:
            item = calls.get(call.index)
        out = b""
        if item is None:
            call_id = call.id or fallback_call_id(self.meta.id, call.index)
            out, item = self._open("function_call", "fc", call_id=call_id, name=call.name or "")
            calls[call.index] = item
        elif not item.name and call.name:
            item.name = call.name
        if call.id is not None:
            self._call_ids.setdefault(call.id, item)
        if call.arguments:
            if item.filled:  # its pieces after all (interleaved calls): not "{}" + pieces
                item.chunks.clear()
                item.filled = False
            item.chunks.append(call.arguments)
            if item is self._current or item in self._calls_open:
                out += self._event(
                    "response.function_call_arguments.delta",
                    {"item_id": item.id, "output_index": item.index, "delta": call.arguments},
                )
        return out


def _whole(call: _Item) -> bool:
    """Whether a call's arguments so far are a whole JSON value (its pieces are over)."""
    try:
        orjson.loads("".join(call.chunks))
    except orjson.JSONDecodeError:
        return False
    return True


def _where(item: _Item) -> dict[str, Any]:
    """The address of the open message item's current content part."""
    return {"item_id": item.id, "output_index": item.index, "content_index": len(item.parts) - 1}


def _added(item: _Item) -> dict[str, Any]:
    """The item as ``output_item.added`` announces it: empty, in progress."""
    if item.kind == "reasoning":
        return reasoning_item(item.id, None)
    if item.kind == "message":
        return message_item(item.id, [], "in_progress")
    return function_call_item(item.id, item.call_id, item.name, "", "in_progress")


def final_response(
    meta: StreamMeta, events: Iterable[StreamEvent], failure: Error | None
) -> dict[str, Any]:
    """The ``response`` object a finished log ends with: what the last event of its stream
    (``response.completed``, ``.incomplete`` or, with ``failure``, ``.failed``) carries, so
    that ``GET /v1/responses/{id}`` answers what the stream said. ``events`` are the log's,
    its terminal entry left out."""
    encoder = ResponsesSSEEncoder(replace(meta, retry_ms=None))
    for event in events:
        encoder.encode(event)
    last = encoder.end() if failure is None else encoder.error(failure)
    data = last[last.rindex(b"\ndata: ") + 7 :]
    response: dict[str, Any] = orjson.loads(data)["response"]
    return response


_RATE_LIMITED = frozenset(("upstream_rate_limited", "rate_limit_exceeded", "insufficient_quota"))


def _failed_code(event: Error) -> str:
    """The ``response.failed`` error code, from the set the Responses API defines."""
    if event.error_type == "rate_limit_error" or event.code in _RATE_LIMITED:
        return "rate_limit_exceeded"
    return "server_error"

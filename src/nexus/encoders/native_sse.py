"""Native SSE with named events: ``event: <type>`` plus the NDJSON object as data.

For ``EventSource`` listeners and other clients that route on the event name
without parsing the payload. Ends with ``event: done``. The error event carries the
response's request id as ``error.request_id``.
"""

from __future__ import annotations

import orjson

from ..events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Heartbeat,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
    plain_content,
)
from .base import Encoder

__all__ = ["NativeSSEEncoder"]

_dumps = orjson.dumps
_HEADS = {
    cls: b"event: %s\ndata: " % cls.type.encode()
    for cls in (Delta, Reasoning, ToolCall, Audio, Image, Citation, Usage, Error, Heartbeat, Done)
}
_CONTENT_HEAD = b'event: delta\ndata: {"type":"delta","delta":{"content":'
_END = b'event: done\ndata: {"type":"done"}\n\n'


class NativeSSEEncoder(Encoder):
    media_type = "application/vnd.nexus.events+sse"
    content_type = "text/event-stream; charset=utf-8"
    aliases = ("nexus", "nexus-sse")

    def start(self) -> bytes:
        if self.meta.retry_ms is not None:
            return b"retry: %d\n\n" % self.meta.retry_ms
        return b""

    def encode(self, event: StreamEvent) -> bytes:
        content = plain_content(event)
        if content is not None:  # the commonest frame, around one dumps() of the text
            return _CONTENT_HEAD + _dumps(content) + b"}}\n\n"
        return _HEADS[type(event)] + _dumps(event.to_dict()) + b"\n\n"

    def error(self, event: Error) -> bytes:
        return _HEADS[Error] + _dumps(event.to_dict(self.request_id)) + b"\n\n"

    def heartbeat(self) -> bytes:
        # A comment line; no blank line, which would dispatch an empty event in
        # decoders that keep the last id pending (the openai SDK's, §1).
        return b": ping\n"

    def end(self) -> bytes:
        return _END

"""NDJSON: one event object per line; the stream ends with ``{"type":"done"}``.

One line per log entry (a resume counts lines): an early partial usage is a line
too, marked ``"partial": true``. The error line carries the response's request id
as ``error.request_id``.
"""

from __future__ import annotations

import orjson

from ..events import Error, StreamEvent, plain_content
from .base import Encoder

__all__ = ["NDJSONEncoder"]

_dumps = orjson.dumps
_NEWLINE = orjson.OPT_APPEND_NEWLINE
_CONTENT_HEAD = b'{"type":"delta","delta":{"content":'


class NDJSONEncoder(Encoder):
    media_type = "application/x-ndjson"
    aliases = ("ndjson", "jsonl")

    content_frame = (_CONTENT_HEAD, b"}}\n")

    def encode(self, event: StreamEvent) -> bytes:
        content = plain_content(event)
        if content is not None:
            return _CONTENT_HEAD + _dumps(content) + b"}}\n"
        return _dumps(event.to_dict(), option=_NEWLINE)

    frame_encode = encode  # what content_frame stands for

    def error(self, event: Error) -> bytes:
        return _dumps(event.to_dict(self.request_id), option=_NEWLINE)

    def heartbeat(self) -> bytes:
        return b'{"type":"heartbeat"}\n'

    def end(self) -> bytes:
        return b'{"type":"done"}\n'

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

    def encode(self, event: StreamEvent) -> bytes:
        content = plain_content(event)
        if content is not None:  # the commonest line, around one dumps() of the text
            return _CONTENT_HEAD + _dumps(content) + b"}}\n"
        return _dumps(event.to_dict(), option=_NEWLINE)

    def error(self, event: Error) -> bytes:
        return _dumps(event.to_dict(self.request_id), option=_NEWLINE)

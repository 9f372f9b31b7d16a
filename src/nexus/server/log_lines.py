"""How a log line of Nexus's own is written: text fields that a client's strings cannot
forge (:func:`log_value`), keys redacted once a line (:func:`line`), and the JSON format
(:class:`JsonFormatter`, ``[logging] format = "json"``), where any line logged while a
request is served (an upstream's error text, a fallback) carries its id
(:mod:`nexus.log_context`)."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import orjson

from .redaction import redact

__all__ = [
    "TEXT_FORMAT",
    "JsonFormatter",
    "WorkerTag",
    "line",
    "log_value",
    "quoted",
    "text_formatter",
]


def line(logger: logging.Logger, level: int, request_id: str, fields: dict[str, Any]) -> None:
    """One line of ``fields`` (None left out of the text; every one in the JSON format),
    with :func:`~nexus.server.redaction.redact` applied: a client may put its own key in
    what the line quotes (the path, the model). One check a line, none a chunk, on the
    values as they are (quoted, ``"\nBearer <key>"`` would hide its credential from the
    patterns, and the JSON format writes the raw value)."""
    raw = "\n".join(v for v in fields.values() if isinstance(v, str))
    if redact(raw) != raw:
        fields = {k: redact(v) if isinstance(v, str) else v for k, v in fields.items()}
    text = " ".join(f"{k}={log_value(v)}" for k, v in fields.items() if v is not None)
    extra = {"request_id": request_id, "access": fields}
    logger.log(level, "%s %s", request_id, text, extra=extra)


_PLAIN = re.compile(r"[\x21-\x7e]+")
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def log_value(value: object) -> object:
    """A value as the text line shows it: a string with spaces, quotes, ``=`` or control
    characters (a client's model name, its request id) is JSON-quoted, so that it cannot
    forge fields (``client_request_id=key=victim`` read as a ``key``) or lines. Not
    redacted: :func:`line` redacts its fields; another caller quoting a client's string
    redacts it first."""
    if isinstance(value, str) and (not _PLAIN.fullmatch(value) or '"' in value or "=" in value):
        # ASCII-escaped: orjson keeps U+2028, U+2029 and U+0085, which split a line
        # for readers that break on every Unicode line boundary.
        return json.dumps(value)
    return value


def quoted(value: str | None) -> object:
    """A client's string (a model name) for a log line other than :func:`line`'s: its
    credentials redacted, then quoted as :func:`log_value` does."""
    return log_value(None if value is None else redact(value))


TEXT_FORMAT = "%(asctime)s %(levelname)s %(worker)s%(name)s: %(message)s"


def text_formatter() -> logging.Formatter:
    """The text log's lines: a worker's name its index (``worker=1``; see :class:`WorkerTag`)."""
    return logging.Formatter(TEXT_FORMAT, defaults={"worker": ""})


class WorkerTag(logging.Filter):
    """Names the worker of ``--workers N`` on each of its records: their lines interleave
    in one log (two workers' shutdown lines told apart)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.tag = f"worker={index} "

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.tag
        record.worker_index = self.index
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id, access fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            out["request_id"] = request_id
        worker = getattr(record, "worker_index", None)
        if worker is not None:
            out["worker"] = worker
        access = getattr(record, "access", None)
        if access is not None:
            out.update(access)
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        elif record.exc_text:  # formatted (and redacted) by a filter: see server/redaction.py
            out["error"] = record.exc_text
        # orjson keeps U+2028, U+2029 and U+0085 raw: escaped, a client's string cannot
        # split the record for a reader that breaks lines on them.
        return orjson.dumps(out).decode().translate(_LINE_BREAKS)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return time.strftime(datefmt or "%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))

"""Credentials out of log lines: :func:`redact`, and the :class:`RedactingFilter` that applies it.

A malformed request is reported by aiohttp's HTTP parser with the raw bytes
around the fault: ``Invalid header value char: b'Authorization: Bearer
<key>\\x7f'``. That text reached the log (message and traceback) and the 400
body. The connection layer (:mod:`nexus.server.connection`) no longer logs or
sends it; this module is the net under everything else that logs for aiohttp:
``nexus serve`` installs the filter on aiohttp's loggers (and asyncio's), and an
embedding application can do the same with :func:`install`.

What :func:`redact` removes (a value is replaced by ``[redacted]``):

* the value of an ``Authorization``, ``Proxy-Authorization``, ``x-api-key``,
  ``Cookie`` or ``Set-Cookie`` header, to the end of its line (a real line
  break or an escaped ``\\r`` / ``\\n`` in a bytes repr);
* a ``Bearer`` or ``Basic`` credential wherever it stands (a header line cut
  short, or without its name);
* the key in a ``nexus-key.<key>`` WebSocket subprotocol;
* a Nexus key (``nx-`` and 16 or more URL-safe characters, what
  ``nexus hash-key`` makes), even glued to other text;
* a bytes literal (``b'...'``): in a log line, that is raw wire data, such as
  the parser's excerpt of a folded header line, which has no name to go by.

Sans-I/O: text in, text out; it over-redacts rather than under-redacts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

__all__ = ["AIOHTTP_LOGGERS", "RedactingFilter", "install", "parse_error_reason", "redact"]

AIOHTTP_LOGGERS = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
    "asyncio",
)
"""The loggers :func:`install` covers by default: aiohttp's (a filter on a logger
applies to its own records only, not its children's) and asyncio's, which reports
exceptions raised in protocol callbacks."""

REDACTED = "[redacted]"

_SECRETS = re.compile(
    # A bytes literal: raw wire data quoted by a parser.
    r"""(?P<bytes>\bb(?P<q>['"])(?:(?!(?P=q))[^\\\n]|\\.)*(?P=q))"""
    # A credential header (also as a quoted dict key): its value, to the end of the line.
    r"""|(?P<header>\b(?:proxy-authorization|authorization|x-api-key|set-cookie|cookie)"""
    r"""['"]?[ \t]*:)(?:[^\r\n\\]|\\(?![rn]))*"""
    r"""|(?P<scheme>\b(?:bearer|basic)[ \t]+)\S+"""
    r"""|(?P<subprotocol>nexus-key\.)[^\s,]+"""
    r"""|nx-[A-Za-z0-9_-]{16,}""",
    re.IGNORECASE,
)


def _replace(match: re.Match[str]) -> str:
    if match.group("bytes") is not None:
        return f"b'{REDACTED}'"
    for prefix in ("header", "scheme", "subprotocol"):
        found = match.group(prefix)
        if found is not None:
            return f"{found} {REDACTED}" if prefix == "header" else f"{found}{REDACTED}"
    return f"nx-{REDACTED}"


def redact(text: str) -> str:
    """``text`` without the credentials listed in the module docstring."""
    return _SECRETS.sub(_replace, text)


_EXCERPT = re.compile(r"""(?:\s*:\s*|\s+)b?['"].*$""")


def parse_error_reason(message: str) -> str:
    """What an HTTP parser error says, without the excerpt it quotes.

    ``"Invalid header value char:\\n\\n  b'...'\\n  ^"`` -> ``"Invalid header
    value char"``; ``"Got more than 8190 bytes when reading: b'...'."`` ->
    ``"Got more than 8190 bytes when reading"``. The first line, cut where a
    quoted excerpt starts, redacted, at most 120 characters.
    """
    first = message.strip().split("\n", 1)[0]
    first = _EXCERPT.sub("", first).rstrip(" :.")
    return redact(first)[:120] or "malformed request"


class RedactingFilter(logging.Filter):
    """Applies :func:`redact` to a record's message (with its arguments), its exception
    text and its stack text. Never drops a record.

    The exception is formatted here, redacted, and kept as ``exc_text`` with
    ``exc_info`` cleared, so no formatter down the line can format the raw one
    again (:class:`logging.Formatter` prints ``exc_text`` when it is set).
    """

    formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit the format: keep the parts, redacted
            message = f"{record.msg} {record.args!r}"
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[0] is not None:
            text = record.exc_text or self.formatter.formatException(record.exc_info)
            record.exc_info, record.exc_text = None, redact(text)
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install(loggers: Iterable[str] = AIOHTTP_LOGGERS) -> RedactingFilter:
    """Put one :class:`RedactingFilter` on each named logger (once: a repeat call adds none)."""
    redacting = RedactingFilter()
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(redacting)
    return redacting

"""Credentials out of log lines: :func:`redact`, and the :class:`RedactingFilter` that applies it.

aiohttp's HTTP parser reports a malformed request with the raw bytes around the fault
(``Invalid header value char: b'Authorization: Bearer <key>\\x7f'``). The connection
layer no longer logs or sends that; this is the net under whatever else logs for
aiohttp: ``nexus serve`` installs the filter on aiohttp's and asyncio's loggers
(:func:`install`). It replaces with ``[redacted]``: the value of a credential header
(``Authorization``, ``Proxy-Authorization``, ``x-api-key``, ``Cookie``, ``Set-Cookie``)
to the end of its line; a ``Bearer`` or ``Basic`` credential anywhere; the key of a
``nexus-key.<key>`` subprotocol; a Nexus key (``nx-`` and 16+ URL-safe characters);
and any bytes literal (``b'...'``), raw wire data with no name to go by. Sans-I/O; it
over-redacts rather than under-redacts.
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
"""Each named: a logger's filter does not see its children's records."""

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
    """What an HTTP parser error says, without the excerpt it quotes: its first line,
    cut where a quoted excerpt starts, redacted, at most 120 characters."""
    first = message.strip().split("\n", 1)[0]
    first = _EXCERPT.sub("", first).rstrip(" :.")
    return redact(first)[:120] or "malformed request"


class RedactingFilter(logging.Filter):
    """Applies :func:`redact` to a record's message, exception and stack text; never drops
    one. The exception is kept formatted (``exc_text``, ``exc_info`` cleared), so no
    formatter down the line can format the raw one again."""

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

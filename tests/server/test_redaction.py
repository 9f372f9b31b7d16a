"""redact(): credentials out of log text; RedactingFilter on records; parse error reasons."""

from __future__ import annotations

import logging

import pytest

from nexus.server.redaction import RedactingFilter, install, parse_error_reason, redact

KEY = "nx-Zq3s9dWk2Hf8Lp0Rt5Vb7Nc1Xm4Jg6Ye"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Authorization: Bearer sk-123", "Authorization: [redacted]"),
        ("authorization:Bearer sk-123\r\nHost: x", "authorization: [redacted]\r\nHost: x"),
        ("Proxy-Authorization: Basic dXNlcjpwdw==", "Proxy-Authorization: [redacted]"),
        ("X-Api-Key: sk-123\nnext line", "X-Api-Key: [redacted]\nnext line"),
        ("x-api-key : sk-123", "x-api-key : [redacted]"),
        ("Cookie: session=abc; other=def", "Cookie: [redacted]"),
        ("Set-Cookie: session=abc", "Set-Cookie: [redacted]"),
        # A bytes repr: the value ends at an escaped line break.
        (r"Authorization: Bearer sk\x7f\r\nHost: x", r"Authorization: [redacted]\r\nHost: x"),
        # Headers in a dict or multidict repr.
        ("{'Authorization': 'Bearer sk-1', 'Accept': '*'}", "{'Authorization': [redacted]"),
        # No header name, or a mangled one: the scheme gives it away.
        ("Authorization Bearer sk-1 tail", "Authorization Bearer [redacted] tail"),
        ("Auth\\x01orization: Bearer sk-1", "Auth\\x01orization: Bearer [redacted]"),
        (
            "Sec-WebSocket-Protocol: nexus.v1, nexus-key.sk-1, x",
            "Sec-WebSocket-Protocol: nexus.v1, nexus-key.[redacted], x",
        ),
        (f"a key {KEY} here", "a key nx-[redacted] here"),
        (f"glued{KEY}", "gluednx-[redacted]"),
        # Raw wire data quoted by a parser: no name to go by (a folded header line).
        (
            f"Unexpected whitespace:\n\n  b' {KEY}'\n    ^",
            "Unexpected whitespace:\n\n  b'[redacted]'\n    ^",
        ),
        (
            'Got more than 8190 bytes when reading: b"it\'s".',
            "Got more than 8190 bytes when reading: b'[redacted]'.",
        ),
        # Nothing to redact.
        ("GET /v1/models 200", "GET /v1/models 200"),
        ("authorization failed for key 'app'", "authorization failed for key 'app'"),
        ("", ""),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("Invalid header value char:\n\n  b'Authorization: x'\n   ^", "Invalid header value char"),
        (
            "Got more than 8190 bytes when reading: b'Bearer x...'.",
            "Got more than 8190 bytes when reading",
        ),
        ("Bad status line:\n  Expected HTTP/:\n\n  b'GET /x'\n  ^", "Bad status line"),
        (
            "Content-Length can't be present with Transfer-Encoding:\n\n  b'x'",
            "Content-Length can't be present with Transfer-Encoding",
        ),
        ("Invalid HTTP header: 'x-api-key: sk-1'", "Invalid HTTP header"),
        (f"{KEY}", "nx-[redacted]"),
        ("", "malformed request"),
    ],
)
def test_parse_error_reason(message: str, reason: str) -> None:
    assert parse_error_reason(message) == reason


def record(msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, msg, args, exc_info)


def test_filter_redacts_message_args_and_exception() -> None:
    try:
        raise ValueError(f"bad header: b'Authorization: Bearer {KEY}'")
    except ValueError as exc:
        rec = record("from %s: %s", "1.2.3.4", f"x-api-key: {KEY}", exc=exc)
    assert RedactingFilter().filter(rec) is True
    assert rec.getMessage() == "from 1.2.3.4: x-api-key: [redacted]"
    assert rec.exc_info is None  # no formatter can format the raw exception again
    assert rec.exc_text is not None and "ValueError" in rec.exc_text and KEY not in rec.exc_text
    for formatter in (logging.Formatter("%(message)s"), _json_formatter()):
        out = formatter.format(rec)
        assert KEY not in out and KEY[3:] not in out
        assert "ValueError" in out  # the traceback is still there, redacted


def _json_formatter() -> logging.Formatter:
    from nexus.server.log_lines import JsonFormatter

    return JsonFormatter()


def test_filter_leaves_clean_records_alone() -> None:
    rec = record("served %d requests", 3)
    RedactingFilter().filter(rec)
    assert (rec.msg, rec.args) == ("served %d requests", (3,))


def test_filter_survives_arguments_that_do_not_fit() -> None:
    rec = record("%d", f"Bearer {KEY}")
    RedactingFilter().filter(rec)
    assert KEY not in rec.getMessage()


def test_install_once_per_logger() -> None:
    name = "test.redaction.install"
    logger = logging.getLogger(name)
    install([name])
    install([name])
    assert sum(isinstance(f, RedactingFilter) for f in logger.filters) == 1
    for f in list(logger.filters):
        logger.removeFilter(f)

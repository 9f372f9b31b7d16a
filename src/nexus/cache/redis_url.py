"""Redis URLs: checked as the client will parse them, shown without credentials.

A ``[store] url`` may hold a password (``redis://:pw@host``, ``?password=``): what
is shown of it, in logs and errors, never does.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

__all__ = ["check_url", "redact_url", "scrub"]


def check_url(url: str) -> str:
    """``url``, if the client can parse it; else a :class:`ValueError` without its
    credentials (a port that is no number, ``?socket_timeout=abc``: a traceback at start
    before)."""
    from redis.asyncio.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"not a Redis URL the client can use: {scrub(str(exc), url)}") from None
    return url


def redact_url(url: str) -> str:
    """``url`` without user, password and query (which may hold ``password=``): fit for logs."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        return "<unparseable Redis URL>"
    return f"{parts.scheme}://{host}{parts.path}"  # urlunsplit would drop unix:// 's slashes


def scrub(message: str, url: str) -> str:
    """``message`` with the URL's credentials cut out, should a driver ever echo them."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        secrets = [parts.password, parts.username, *query.get("password", ())]
    except ValueError:
        return "(details withheld)"
    for secret in secrets:
        if secret:
            message = message.replace(secret, "***")
    return message

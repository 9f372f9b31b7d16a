"""A Redis URL fit for logs and errors: its credentials never leave the configuration."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

__all__ = ["redact_url", "scrub"]


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

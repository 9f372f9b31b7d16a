"""Redis URLs: checked as the client will parse them, shown without credentials, and
connected to (:func:`connect`).

A ``[store] url`` may hold a password (``redis://:pw@host``, ``?password=``): what
is shown of it, in logs and errors, never does. redis-py is imported only when used
(it pulls in more than a gateway on the memory store needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["check_url", "connect", "redact_url", "scrub"]


def connect(
    url: str,
    *,
    max_connections: int,
    pool_timeout_s: float,
    socket_timeout_s: float | None,
    client_name: str,
) -> aioredis.Redis:
    """A client of a pool of its own: ``max_connections`` at most, a command waiting up to
    ``pool_timeout_s`` for one, then failing. ``socket_timeout_s=None``: no timer per reply
    (the caller bounds its round trips itself)."""
    import redis.asyncio as aioredis
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.retry import Retry

    plain: dict[str, Any] = {}
    try:  # redis-py 7 and later
        from redis.maint_notifications import MaintNotificationsConfig

        # Left at "auto" (a Redis Enterprise feature Nexus does not use), redis-py's pool
        # skips its check that a pooled connection is still open: after a Redis restart the
        # first command on each idle connection failed ("Connection closed by server"), and
        # an admission then fell back to this process's own count.
        plain["maint_notifications_config"] = MaintNotificationsConfig(False)
    except ImportError:  # earlier: no such notifications, and the pool checks every connection
        pass
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=False,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=5.0,
        client_name=client_name,  # CLIENT LIST names the replica
        retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.25), retries=3),
        **plain,
    )
    return aioredis.Redis.from_pool(pool)  # closes the pool with it


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

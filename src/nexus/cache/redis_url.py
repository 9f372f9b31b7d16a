"""Redis URLs: checked as the client will parse them, shown without credentials, and
connected to (:func:`connect`); and Redis's failures told the same way (:class:`Failures`).

A ``[store] url`` may hold a password (``redis://:pw@host``, ``?password=``): what
is shown of it, in logs and errors, never does. redis-py is imported only when used
(it pulls in more than a gateway on the memory store needs).
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from ..config_types import check_host_and_port

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["WARN_EVERY_S", "Failures", "check_url", "connect", "redact_url", "scrub"]

log = logging.getLogger("nexus.store")

WARN_EVERY_S = 10.0
"""The least time between two warnings of failed Redis calls of one cause."""


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
    """``url``, if the client can parse it and connect to its host and port; else a
    :class:`ValueError` without its credentials (a port that is no number,
    ``?socket_timeout=abc``: a traceback at start before; no host, or port 0: the
    client's default, unsaid)."""
    from redis.asyncio.connection import parse_url

    unusable = "not a Redis URL the client can use"
    if not url.startswith("unix://"):  # (a socket's path, no host)
        try:
            check_host_and_port(url)
        except ValueError as exc:  # (its own words: nothing of the URL in them)
            raise ValueError(f"{unusable}: {exc}") from None
        # The database is the path's number: the client takes "/7x" or "/1/2" (db 12) for
        # database 0 or another, unsaid, sharing its keys (budgets) with whoever uses it.
        path = urlsplit(url).path
        if path not in ("", "/") and not (path[1:].isascii() and path[1:].isdigit()):
            raise ValueError(f"{unusable}: its path must be a database number, as /0")
    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"{unusable}: {scrub(str(exc), url)}") from None
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


_PASSWORD_PARAM = re.compile(r"(password=)[^&\s'\"]+", re.IGNORECASE)


def scrub(message: str, url: str) -> str:
    """``message`` with the URL's credentials cut out, should a driver or Redis ever echo
    them: its userinfo (``user:pw@``), a ``password=`` parameter, and a credential that
    stands as a word of its own (``'pw'``). Never inside a word: cut out wherever it
    occurred, a user ``u`` made "Port could not be cast" "Port co***ld not be cast", the
    message garbled and the credential's letters told by where the ``***`` fell."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
    except ValueError:
        return "(details withheld)"
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and userinfo:
        message = message.replace(f"{userinfo}@", "***@")
    message = _PASSWORD_PARAM.sub(r"\1***", message)
    given = [parts.username, parts.password, *query.get("password", ())]
    secrets = {form for secret in given if secret for form in (secret, unquote(secret))}
    for secret in sorted(secrets, key=len, reverse=True):  # (a longer one holding another)
        message = re.sub(rf"(?<!\w){re.escape(secret)}(?!\w)", "***", message)
    return message


class Failures:
    """Warnings of failed Redis calls: the error's class and what Redis said (scrubbed of
    the URL's credentials), at most one every :data:`WARN_EVERY_S` per cause, the next
    saying how many went unsaid meanwhile. Without them a Redis that answered but refused
    every write (``OOM``, ``NOPERM``, ``READONLY`` after a failover) made each new stream
    a 503 with nothing in the log to say why."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._warned: dict[str, float] = {}
        self._unsaid: dict[str, int] = {}

    def failed(self, op: str, cause: str, exc: BaseException) -> None:
        now, last = time.monotonic(), self._warned.get(cause)
        if last is not None and now - last < WARN_EVERY_S:
            self._unsaid[cause] = self._unsaid.get(cause, 0) + 1
            return
        unsaid = self._unsaid.pop(cause, 0)
        self._warned[cause] = now
        log.warning(
            "a Redis call failed (%s, in %s): %s: %s%s",
            cause,
            op,
            type(exc).__name__,
            scrub(str(exc), self.url),
            f" ({unsaid} more {cause} suppressed since the last)" if unsaid else "",
        )

"""Read tokens: signed, expiring, read-only capabilities for one stream. Sans-I/O.

A browser's ``EventSource`` sends no ``Authorization``, so a background request's
``202`` carries a token that alone authorises ``GET /v1/streams/{id}?token=...``.
A token is ``<expires>.<mac>``: a Unix time in whole seconds, and the base64url
HMAC-SHA256 of the scope, the stream id (from the URL; the token does not carry it)
and ``expires`` under the token secret, compared in constant time. The secret is in the
variable ``[auth] token_secret_env`` names, the same on every replica; without one each
process makes its own, and its tokens work on it alone.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping

from .errors import ConfigError

__all__ = ["MIN_SECRET_CHARS", "READ", "StreamTokens", "new_secret", "secret_from_env"]

READ = "read"
"""The only scope: read one stream (GET, with resume)."""
MIN_SECRET_CHARS = 32

_MAX_TOKEN_CHARS = 64
_MAC_CHARS = 43  # 32 bytes, base64url without padding
_MAX_EXPIRES_DIGITS = 12


def new_secret() -> str:
    """A fresh random secret (256 bits), for a process that was given none."""
    return secrets.token_urlsafe(32)


def secret_from_env(name: str, environ: Mapping[str, str]) -> str | None:
    """The secret in ``environ[name]``, or None. Raises :class:`ConfigError` for one
    shorter than :data:`MIN_SECRET_CHARS` (blanks aside): no start beats forgeable tokens."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"[auth] token_secret_env: the environment variable {name} holds a secret of "
            f"{len(value)} characters; read tokens need at least {MIN_SECRET_CHARS} "
            "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return value


class StreamTokens:
    """Makes and checks the read tokens of one secret."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a token secret must not be empty")
        self._key = hashlib.sha256(b"nexus read token\x00" + secret.encode()).digest()

    def issue(self, stream_id: str, now: float, ttl_s: float) -> str:
        """A token that reads ``stream_id`` until ``now + ttl_s`` (rounded up to a second)."""
        expires = math.ceil(now + ttl_s)
        return f"{expires}.{self._mac(READ, stream_id, expires)}"

    def check(self, token: str, stream_id: str, now: float) -> bool:
        """Whether ``token`` reads ``stream_id`` at ``now``: well formed, this stream's,
        made with this secret, unexpired."""
        if len(token) > _MAX_TOKEN_CHARS:
            return False
        expires_text, dot, mac = token.partition(".")
        if (
            not dot
            or len(mac) != _MAC_CHARS
            or not expires_text.isascii()
            or not expires_text.isdigit()
            or len(expires_text) > _MAX_EXPIRES_DIGITS
        ):
            return False
        expires = int(expires_text)
        if str(expires) != expires_text:  # one spelling per token: no leading zeros
            return False
        expected = self._mac(READ, stream_id, expires)
        if not hmac.compare_digest(expected.encode(), mac.encode("ascii", "replace")):
            return False
        return now < expires

    def _mac(self, scope: str, stream_id: str, expires: int) -> str:
        message = f"{scope}\x00{stream_id}\x00{expires}".encode("utf-8", "surrogateescape")
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

"""Read tokens: signed, expiring, read-only capabilities for one stream. Sans-I/O.

A browser's ``EventSource`` cannot send an ``Authorization`` header, so the
``202`` of a background request carries a *read token* for its stream, and
``GET /v1/streams/{id}?token=<token>`` is authorised by it alone. A token is::

    <expires>.<mac>

``expires`` is a Unix time in whole seconds (decimal); ``mac`` is the
HMAC-SHA256, base64url without padding, of the scope (``read``), the stream id
and ``expires``, under the gateway's token secret. The stream id is not in the
token: it is the URL's, and a token made for another stream does not verify.
Nothing else (no DELETE, no POST, no other stream) accepts a token. The MAC is
compared with :func:`hmac.compare_digest`, so the time a check takes does not
say how much of a forged MAC was right.

The secret comes from the environment variable ``[auth] token_secret_env``
names (:func:`secret_from_env`), the same on every replica and worker that
serves the same streams; without one, each process makes its own
(:func:`new_secret`) and its tokens work on it alone.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping

from .errors import ConfigError

__all__ = [
    "MIN_SECRET_CHARS",
    "READ",
    "StreamTokens",
    "new_secret",
    "secret_from_env",
]

READ = "read"
"""The only scope there is: read one stream (GET, with resume)."""

MIN_SECRET_CHARS = 32
"""A configured secret shorter than this is refused: a token's MAC is only as strong
as the secret an attacker would have to guess."""

_MAX_TOKEN_CHARS = 64
_MAC_CHARS = 43  # 32 bytes, base64url without padding
_MAX_EXPIRES_DIGITS = 12


def new_secret() -> str:
    """A fresh random secret (256 bits), for a process that was given none."""
    return secrets.token_urlsafe(32)


def secret_from_env(name: str, environ: Mapping[str, str]) -> str | None:
    """The secret in ``environ[name]``; None when it is absent or empty.

    Raises :class:`ConfigError` for a secret shorter than :data:`MIN_SECRET_CHARS`
    (leading and trailing blanks do not count): better no start than tokens an
    attacker can forge.
    """
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
    """Makes and checks the read tokens of one secret. See the module docstring."""

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

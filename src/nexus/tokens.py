"""Read tokens: signed, expiring, read-only capabilities for one stream. Sans-I/O.

A browser's ``EventSource`` sends no ``Authorization``, so a background request's
``202`` carries a token that alone authorises ``GET /v1/streams/{id}?token=...``.
A token is ``<expires>.<mac>.<key>``: a Unix time in whole seconds, the base64url
HMAC-SHA256 of the scope, the stream id (from the URL; the token does not carry it),
``expires`` and the key under the token secret, compared in constant time, and the name of
the API key the token was issued to, whose reader places and rate its reads take (with
``[cache] share_across_keys`` that may be another key than the stream's owner). Without
keys there is no ``.<key>``. The secret is in the
variable ``[auth] token_secret_env`` names, the same on every replica; without one each
process makes its own, and its tokens work on it alone.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["MIN_SECRET_CHARS", "READ", "Grant", "StreamTokens", "new_secret", "secret_from_env"]

READ = "read"
"""The only scope: read one stream (GET, with resume)."""
MIN_SECRET_CHARS = 32

_MAX_TOKEN_CHARS = 128
_KEY_NAME = re.compile(r"[A-Za-z0-9_.@:-]{1,64}")  # as [[auth.keys]] name allows
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


@dataclass(frozen=True, slots=True)
class Grant:
    """What a valid token grants: reading its stream, charged to ``key`` (None: a token
    without a key, made without keys or by an older version: the stream owner's)."""

    key: str | None


class StreamTokens:
    """Makes and checks the read tokens of one secret."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a token secret must not be empty")
        self._key = hashlib.sha256(b"nexus read token\x00" + secret.encode()).digest()

    def issue(self, stream_id: str, now: float, ttl_s: float, key: str | None = None) -> str:
        """A token that reads ``stream_id`` until ``now + ttl_s`` (rounded up to a second),
        its reads charged to the API key named ``key``."""
        expires = math.ceil(now + ttl_s)
        token = f"{expires}.{self._mac(READ, stream_id, expires, key)}"
        return token if key is None else f"{token}.{key}"

    def check(self, token: str, stream_id: str, now: float) -> Grant | None:
        """What ``token`` grants on ``stream_id`` at ``now``: None unless well formed, this
        stream's, made with this secret (the key it names included), unexpired."""
        if len(token) > _MAX_TOKEN_CHARS:
            return None
        expires_text, dot, rest = token.partition(".")
        mac, named, key = rest.partition(".")
        if (
            not dot
            or len(mac) != _MAC_CHARS
            or not expires_text.isascii()
            or not expires_text.isdigit()
            or len(expires_text) > _MAX_EXPIRES_DIGITS
            or (named and not _KEY_NAME.fullmatch(key))
        ):
            return None
        expires = int(expires_text)
        if str(expires) != expires_text:  # one spelling per token: no leading zeros
            return None
        expected = self._mac(READ, stream_id, expires, key if named else None)
        if not hmac.compare_digest(expected.encode(), mac.encode("ascii", "replace")):
            return None
        return Grant(key if named else None) if now < expires else None

    def _mac(self, scope: str, stream_id: str, expires: int, key: str | None) -> str:
        text = f"{scope}\x00{stream_id}\x00{expires}"
        if key is not None:  # (the ids and names signed have no NUL: no two read alike)
            text += f"\x00{key}"
        message = text.encode("utf-8", "surrogateescape")
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

"""API keys and per-key rate limits. Sans-I/O: strings and numbers in, decisions out.

Keys are stored as SHA-256 hashes; a presented key is compared with every stored hash
in constant time, so neither the answer nor its timing says which key matched.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .config import AuthKeyConfig
from .errors import GatewayError

__all__ = [
    "KEY_SUBPROTOCOL",
    "ApiKey",
    "Forbidden",
    "KeyRing",
    "RateLimiter",
    "Unauthorized",
    "credential",
    "hash_key",
    "is_loopback",
    "new_key",
]

KEY_SUBPROTOCOL = "nexus-key."
"""A WebSocket subprotocol ``nexus-key.<key>`` carries a key from a browser."""


class Unauthorized(GatewayError):
    status = 401
    code = "invalid_api_key"
    error_type = "authentication_error"


class Forbidden(GatewayError):
    status = 403
    code = "model_not_allowed"
    error_type = "permission_error"


def hash_key(key: str) -> str:
    """The SHA-256 of a key, hex: what ``[[auth.keys]] sha256`` holds."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return "nx-" + secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def credential(headers: Mapping[str, str], subprotocols: Sequence[str] = ()) -> str | None:
    """The key a request presents (``Authorization: Bearer``, ``x-api-key`` or, for a
    browser's WebSocket, the subprotocol ``nexus-key.<key>``), or None."""

    value = headers.get("Authorization")
    if value is not None:
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    value = headers.get("x-api-key")
    if value is not None and value.strip():
        return value.strip()
    for protocol in subprotocols:
        if protocol.startswith(KEY_SUBPROTOCOL) and len(protocol) > len(KEY_SUBPROTOCOL):
            return protocol[len(KEY_SUBPROTOCOL) :]
    return None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A configured key, by name (the hash stays inside the ring)."""

    name: str
    models: tuple[str, ...] | None = None
    budget_usd: float | None = None
    """What it may spend per ``budget_period`` (see :mod:`nexus.budgets`); None: no budget."""
    budget_period: str = "month"

    def allows(self, model: str) -> bool:
        if self.models is None:
            return True
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


class KeyRing:
    """The configured keys. Empty: authentication is off."""

    def __init__(self, keys: Sequence[AuthKeyConfig] = ()) -> None:
        self._keys = [
            (
                bytes.fromhex(key.sha256),
                ApiKey(
                    key.name,
                    None if key.models is None else tuple(key.models),
                    key.budget_usd,
                    key.budget_period,
                ),
            )
            for key in keys
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def keys(self) -> list[ApiKey]:
        """Every configured key, in the config's order."""
        return [key for _, key in self._keys]

    def named(self, name: str | None) -> ApiKey | None:
        """The key called ``name`` (a stream's owner), if it is configured."""
        return next((key for _, key in self._keys if key.name == name), None)

    def lookup(self, presented: str) -> ApiKey | None:
        """The key ``presented`` is, compared in constant time against every stored hash."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found: ApiKey | None = None
        for stored, key in self._keys:
            if hmac.compare_digest(stored, digest):
                found = key
        return found

    def authenticate(self, presented: str | None) -> ApiKey | None:
        """The caller's key; None when auth is off. Raises :class:`Unauthorized`."""
        if not self.enabled:
            return None
        key = None if presented is None else self.lookup(presented)
        if key is None:
            raise Unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
                if presented is None
                else "Invalid API key.",
                headers={"WWW-Authenticate": 'Bearer realm="nexus"'},
            )
        return key


class RateLimiter:
    """Token buckets per key: ``rate`` a second, bursts up to one second's worth."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(rate, 1.0)
        self._buckets: dict[str, tuple[float, float]] = {}

    def acquire(self, key: str, now: float) -> float:
        """Take one token; 0.0 if there was one, else the seconds until there is."""
        if self.rate <= 0:
            return 0.0
        tokens, then = self._buckets.get(key, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate

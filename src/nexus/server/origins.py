"""Which web pages and which ``Host`` names the gateway answers. Pure functions.

Any page a developer opens may send requests to ``127.0.0.1`` (a ``text/plain`` POST
or a WebSocket needs no preflight). :func:`origin_allowed` takes a request whose
``Origin`` is the gateway's own (from the request's ``Host``) or listed in ``[cors]
allow_origins``; ``Origin: null`` only when listed as ``"null"``, never by ``"*"``.
Against DNS rebinding (a page's own name made to resolve to loopback), a gateway
without keys answers only :func:`loopback_host` names unless ``[auth]
allow_unauthenticated`` says otherwise.
"""

from __future__ import annotations

import functools
import ipaddress
import re

__all__ = ["listed", "loopback_host", "origin_allowed", "split_host"]

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::([0-9]{1,5}))?")
_ORIGIN = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.+)")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def split_host(value: str, scheme: str) -> tuple[str, int] | None:
    """``"Example.COM:8080"`` -> ``("example.com", 8080)`` (the scheme's port by default;
    ``[::1]`` keeps its brackets); None for anything else."""
    match = _HOST.fullmatch(value.strip())
    if match is None:
        return None
    host, port = match.group(1).lower().rstrip("."), match.group(2)
    if port is None:
        default = _DEFAULT_PORTS.get(scheme)
        return None if default is None else (host, default)
    return host, int(port)


def listed(origin: str, allowed: list[str]) -> bool:
    """Whether ``origin`` is in ``allowed``, or ``"*"`` is (which never covers ``null``)."""
    return origin in allowed or ("*" in allowed and origin != "null")


def origin_allowed(origin: str, allowed: list[str], *, scheme: str, host: str | None) -> bool:
    """Whether a page at ``origin`` may be served: the request's own origin (``scheme``
    and its ``Host``, ``host``), or one in ``allowed``."""
    if listed(origin, allowed):
        return True
    match = _ORIGIN.fullmatch(origin)
    if match is None or host is None:
        return False
    origin_scheme = match.group(1).lower()
    if origin_scheme != scheme.lower():
        return False
    theirs = split_host(match.group(2), origin_scheme)
    return theirs is not None and theirs == split_host(host, scheme)


@functools.lru_cache(maxsize=64)  # asked on every request of a keyless gateway: few names
def loopback_host(host: str) -> bool:
    """Whether a ``Host`` names this machine: ``localhost`` or a name under it (RFC 6761
    §6.3), 127.0.0.0/8 or ``[::1]``, with any port."""

    parts = split_host(host, "http")
    if parts is None:
        return False
    name = parts[0]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False

"""Which web pages and which ``Host`` names the gateway answers. Pure functions.

A browser lets any page the developer opens send requests to ``127.0.0.1``: a
``text/plain`` POST or a WebSocket needs no CORS preflight, and a keyless gateway on
loopback would run the turn (and a WebSocket's page reads the reply). Browsers name
the page in ``Origin``; :func:`origin_allowed` takes a request whose ``Origin`` is the
gateway's own (the scheme, host and port of the request itself, from its ``Host``) or
one listed in ``[cors] allow_origins``. ``Origin: null`` (sandboxed frames, ``file:``
pages) is never the gateway's own and is taken only when listed as ``"null"``, not
by ``"*"``. Clients that are not browsers send no ``Origin`` and are not concerned.

DNS rebinding gets around that: a page at ``evil.example`` whose name is then made to
resolve to ``127.0.0.1`` is the same origin as the gateway, as far as the browser
knows. Its requests still carry ``Host: evil.example``, so a gateway without keys
answers only :func:`loopback_host` names (``localhost``, ``*.localhost``, 127.0.0.0/8,
``[::1]``). With keys a page has no key to send; with ``[auth] allow_unauthenticated``
the operator serves the gateway to whoever reaches it, by any name.
"""

from __future__ import annotations

import functools
import ipaddress
import re

__all__ = ["loopback_host", "origin_allowed", "split_host"]

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::([0-9]{1,5}))?")
_ORIGIN = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.+)")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def split_host(value: str, scheme: str) -> tuple[str, int] | None:
    """``"Example.COM:8080"`` -> ``("example.com", 8080)``; the scheme's port when none
    is given; ``[::1]`` keeps its brackets. None for anything that is not a host and port."""
    match = _HOST.fullmatch(value.strip())
    if match is None:
        return None
    host, port = match.group(1).lower().rstrip("."), match.group(2)
    if port is None:
        default = _DEFAULT_PORTS.get(scheme)
        return None if default is None else (host, default)
    return host, int(port)


def origin_allowed(origin: str, allowed: list[str], *, scheme: str, host: str | None) -> bool:
    """Whether a request from a page at ``origin`` may be served: the request's own
    origin (``scheme`` and its ``Host`` header, ``host``), or one in ``allowed``
    (``"*"``: any, but ``null``)."""
    if origin in allowed or ("*" in allowed and origin != "null"):
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
    """Whether a ``Host`` header names this machine: ``localhost`` or a name under it
    (RFC 6761 §6.3: they resolve to loopback, never to a rebound address), an address in
    127.0.0.0/8 or ``[::1]``, with any port."""
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

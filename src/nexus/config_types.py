"""The building blocks of the ``config.toml`` tables (:mod:`nexus.config`): the strict
base table, the value types several tables share, and the rules for names.

Every number is finite: ``inf`` and ``nan`` are refused everywhere ("Input should be a
finite number"), and "no limit" is said the way docs/configuration.md gives for the key
(``0`` where it says so), never by an infinity that reaches a timer or a count.
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from .pricing import MAX_USD_PER_MTOK

__all__ = [
    "MAX_DURATION_S",
    "PER_MTOK",
    "PROVIDER_NAME",
    "URL",
    "USD",
    "BaseURL",
    "ModelName",
    "Origin",
    "Table",
    "check_host_and_port",
    "env_name",
    "model_name",
]

MAX_DURATION_S = 1_000_000_000
"""The longest any duration may be, in seconds (about 31 years; a key's own tighter bound
applies first): far past any use, and far below where a duration stops being one Redis or
a timer takes (``resume_ttl_s = 1e16`` was taken, then every stream's ``PX`` was "value
is not an integer or out of range": a 503 each)."""


class Table(BaseModel):
    """A config table: unknown keys refused, frozen, strictly typed, numbers finite,
    durations bounded."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _a_duration_is_bounded(cls, value: object, info: ValidationInfo) -> object:
        """Every duration, known by its name (``*_s``, ``*_ms``), at most
        :data:`MAX_DURATION_S`: one rule for every table, so that a key added later is
        bounded too."""
        name = info.field_name or ""
        unit = "milliseconds" if name.endswith("_ms") else "seconds" if name.endswith("_s") else ""
        limit = MAX_DURATION_S * (1000 if unit == "milliseconds" else 1)
        if unit and isinstance(value, int | float) and value > limit:
            raise ValueError(
                f"Input should be less than or equal to {limit} ({unit}: about 31 years)"
            )
        return value


def _int_to_float(value: object) -> object:
    # Strict mode takes no int for a float, but TOML writes 5 for 5.0.
    return float(value) if type(value) is int else value


USD = Annotated[float | None, BeforeValidator(_int_to_float), Field(default=None, ge=0)]
"""An optional amount of dollars (or dollars per million tokens)."""
PER_MTOK = Annotated[USD, Field(le=MAX_USD_PER_MTOK)]
"""An optional price, bounded so that no count times it is an infinite cost."""
URL = r"^https?://\S+$"


def check_host_and_port(url: str) -> None:
    """A :class:`ValueError` saying what is wrong with ``url``'s host or port as a client
    reads them (:func:`~urllib.parse.urlsplit`), without repeating the URL (it may hold a
    password). A pattern alone let ``http://host:abc/v1``, ``http://127.0.0.1:99999/v1``,
    ``http://:80/v1`` and ``http://[::1/v1`` through to a traceback as the connections
    were set up (in every worker, over and over); and port 0 meant the default port."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("the host is not a valid IPv6 address between [ and ]") from None
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError("the port must be a number from 1 to 65535")
    if not parts.hostname:
        raise ValueError("no host in the URL")


def _a_connectable_url(url: str) -> str:
    check_host_and_port(url)
    return url


BaseURL = Annotated[str, Field(pattern=URL), AfterValidator(_a_connectable_url)]
"""An upstream's ``http(s)://`` URL, host and port checked. (Credentials in it are refused
as the provider is built: :func:`nexus.providers.connections.request_target`.)"""

PROVIDER_NAME = re.compile(r"[^/*\s\x00-\x1f\x7f]{1,64}")
"""A provider's name, the prefix of its model ids: letters, digits, ``_``, ``.``, ``-``."""
_MODEL_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,256}")


def model_name(value: str) -> str:
    """A model (or alias) name as a client sends it: no spaces or control characters."""
    if not _MODEL_NAME.fullmatch(value):
        raise ValueError(
            f"model name {value!r} must be 1 to 256 characters, without spaces or control "
            "characters"
        )
    return value


ModelName = Annotated[str, AfterValidator(model_name)]

_ORIGIN = re.compile(
    r"([a-z][a-z0-9+.-]*)://(\[[0-9a-f:.]+\]|[a-z0-9_-]+(?:\.[a-z0-9_-]+)*)(?::([0-9]{1,5}))?"
)
_DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}


def _an_origin(value: str) -> str:
    """``"*"``, ``"null"`` (listed by name only), or an origin exactly as a browser sends
    it in ``Origin``: ``scheme://host[:port]``, lower case, without the scheme's default
    port, a path or a wildcard. Origins are compared as strings, so any other spelling
    (``https://App.example.com``, ``https://app.example.com:443``, a trailing ``/``) would
    never match a browser's, and is refused with the spelling that would."""
    if value in ("*", "null"):
        return value
    match = _ORIGIN.fullmatch(value)
    port = None if match is None else match.group(3)
    if match is not None and (
        port is None or (port != _DEFAULT_PORTS.get(match.group(1)) and 0 < int(port) < 65536)
    ):
        return value
    hint = 'e.g. "https://app.example.com"'
    spelled = value.strip().lower().rstrip("/")
    scheme = spelled.partition("://")[0]
    if scheme in _DEFAULT_PORTS:
        spelled = spelled.removesuffix(":" + _DEFAULT_PORTS[scheme])
    if spelled != value and _ORIGIN.fullmatch(spelled):
        hint = f"a browser sends it as {spelled!r}"
    raise ValueError(
        f'{value!r} is not an origin as a browser sends it: "*", "null" or '
        f"scheme://host[:port] in lower case, without a default port, path or wildcard ({hint})"
    )


Origin = Annotated[str, AfterValidator(_an_origin)]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_name(value: str | None) -> str | None:
    """An environment variable's name; never repeated when it is not one: it may be the
    secret itself, put there by mistake."""
    if value is not None and not _ENV_NAME.fullmatch(value):
        raise ValueError(
            "must name an environment variable (letters, digits and _), not hold the "
            "secret itself; the value is not repeated here"
        )
    return value

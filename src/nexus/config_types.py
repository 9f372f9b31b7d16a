"""The building blocks of the ``config.toml`` tables (:mod:`nexus.config`): the strict
base table, the value types several tables share, and the rules for names.

Every number is finite: ``inf`` and ``nan`` are refused everywhere ("Input should be a
finite number"), and "no limit" is said the way docs/configuration.md gives for the key
(``0`` where it says so), never by an infinity that reaches a timer or a count.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from .pricing import MAX_USD_PER_MTOK

__all__ = [
    "PER_MTOK",
    "PROVIDER_NAME",
    "URL",
    "USD",
    "ModelName",
    "Origin",
    "Table",
    "env_name",
    "model_name",
]


class Table(BaseModel):
    """A config table: unknown keys refused, frozen, strictly typed, numbers finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _int_to_float(value: object) -> object:
    # Strict mode takes no int for a float, but TOML writes 5 for 5.0.
    return float(value) if type(value) is int else value


USD = Annotated[float | None, BeforeValidator(_int_to_float), Field(default=None, ge=0)]
"""An optional amount of dollars (or dollars per million tokens)."""
PER_MTOK = Annotated[USD, Field(le=MAX_USD_PER_MTOK)]
"""An optional price, bounded so that no count times it is an infinite cost."""
URL = r"^https?://\S+$"

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

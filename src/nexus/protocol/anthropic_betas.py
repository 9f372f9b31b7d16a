"""``anthropic-beta``: the betas a client turns on, and those an Anthropic target sends on.

A client names betas in the ``anthropic-beta`` header (comma-separated, in one header or
several); they ride with its request (two requests that differ in them are not one), and an
Anthropic target sends on those its provider's ``betas`` allow. The others are not sent: a
beta can change prices (the 1M context window bills a long prompt at twice the rate) or
what a stream holds (block types Nexus does not carry), which the operator decides, not
the client. Claude Code names its own (``claude-code-20250219``) on every request: refused,
they would stop it. Sans-I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Annotated

from pydantic import Field

from ..errors import InvalidRequest

__all__ = [
    "BETA",
    "DEFAULT_BETAS",
    "MAX_BETAS",
    "Beta",
    "default_betas",
    "parse_betas",
    "sent_betas",
]

BETA = r"^[a-z0-9][a-z0-9\-]{0,99}$"
"""An ``anthropic-beta`` value (``context-management-2025-06-27``)."""
_BETA = re.compile(BETA)
MAX_BETAS = 32
DEFAULT_BETAS = (
    "context-management-2025-06-27",
    "interleaved-thinking-2025-05-14",
    "fine-grained-tool-streaming-2025-05-14",
    "token-efficient-tools-2025-02-19",
)
"""Betas that change neither prices nor what Nexus reads of a stream: allowed by default."""
Beta = Annotated[str, Field(pattern=BETA)]


def default_betas() -> list[str]:
    return list(DEFAULT_BETAS)


def parse_betas(values: Iterable[str]) -> list[str]:
    """The beta names of ``anthropic-beta`` header values. Raises :class:`InvalidRequest`
    for one that is not a beta's name, or past :data:`MAX_BETAS`."""
    betas = [beta.strip() for value in values for beta in value.split(",") if beta.strip()]
    if len(betas) > MAX_BETAS or not all(_BETA.fullmatch(beta) for beta in betas):
        raise InvalidRequest(
            f"anthropic-beta: {MAX_BETAS} beta names at most, each of lowercase letters, "
            "digits and '-' (context-management-2025-06-27).",
            param="anthropic-beta",
        )
    return betas


def sent_betas(asked: object, allowed: Sequence[str]) -> str | None:
    """The ``anthropic-beta`` header for a request that ``asked`` for betas (its
    ``anthropic_beta``), of those ``allowed``; None when none is left."""
    if not isinstance(asked, list):
        return None
    kept = [beta for beta in dict.fromkeys(asked) if beta in allowed]
    return ",".join(kept) if kept else None

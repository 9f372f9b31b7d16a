"""How a pydantic validation error of ``config.toml`` reads: in the file's own terms
(``[providers.up] idle_timeout_s: ...``), not pydantic's location tuples. Kept apart from
:mod:`nexus.config` so the tables stay in one readable module."""

from __future__ import annotations

from typing import Any

__all__ = ["describe", "in_file"]

_KINDS = ("mock", "openai", "anthropic")
_STORE_KINDS = ("memory", "redis")


def describe(error: Any) -> str:
    """One pydantic error as the file's terms put it: ``[table] key: what is wrong``, with
    the discriminator tags pydantic adds (``kind``) dropped, since no one writes them."""
    loc = [str(p) for p in error["loc"]]
    message = str(error["msg"])
    if error["type"] == "union_tag_not_found":
        loc, message = [*loc, "kind"], "required key is missing"
    elif error["type"] == "union_tag_invalid":
        ctx = error.get("ctx", {})
        loc = [*loc, "kind"]
        message = f"unknown kind {ctx.get('tag')!r} (expected {ctx.get('expected_tags')})"
    if error["type"] == "extra_forbidden":
        message = "unknown key (check the spelling against docs/configuration.md)"
    elif error["type"] == "missing":
        message = "required key is missing"
    elif message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if not loc:
        return message
    if len(loc) == 1:
        return (
            f"{loc[0]}: {message}"
            if error["type"] != "extra_forbidden"
            else (f"[{loc[0]}]: unknown table or key")
        )
    table, rest = loc[0], loc[1:]
    if table == "plugins" and rest and rest[0].isdigit():
        where = f"[[plugins]] #{int(rest[0]) + 1}"
        return f"{where} {'.'.join(rest[1:])}: {message}" if rest[1:] else f"{where}: {message}"
    if table == "auth" and len(rest) >= 2 and rest[0] == "keys" and rest[1].isdigit():
        where = f"[[auth.keys]] #{int(rest[1]) + 1}"
        return f"{where} {'.'.join(rest[2:])}: {message}" if rest[2:] else f"{where}: {message}"
    if table == "store" and rest and rest[0] in _STORE_KINDS:
        rest = rest[1:]  # the discriminator tag again
        if not rest:
            return f"[store]: {message}"
    if table == "providers" and len(rest) >= 2 and rest[1] in _KINDS:
        rest = [rest[0], *rest[2:]]  # drop the discriminator tag pydantic adds
        if len(rest) == 1:
            return f"[providers.{rest[0]}]: {message}"
    if table in ("providers", "models") and len(rest) >= 2:
        name = rest[0] if table == "providers" and "." not in rest[0] else f'"{rest[0]}"'
        return f"[{table}.{name}] {'.'.join(rest[1:])}: {message}"
    return f"[{table}] {'.'.join(rest)}: {message}"


def in_file(message: str, source: str | None) -> str:
    """A config error's message naming the file ``source`` first, as every one does: those
    raised after the file was read (an unset ``api_key_env``) name a table, ``[...]``, but
    know no file. One that names its file already, or a command-line flag, is kept."""
    if source is None or not message.startswith("["):
        return message
    return f"{source}: {message}"

"""The config's tables, for tests that walk every key of a kind (durations, floats)."""

from __future__ import annotations

import pydantic

__all__ = ["REQUIRED", "tables"]


def tables(cls: type[pydantic.BaseModel]) -> list[type[pydantic.BaseModel]]:
    """``cls`` and every table that subclasses it."""
    return [cls, *(t for sub in cls.__subclasses__() for t in tables(sub))]


REQUIRED: dict[str, dict[str, object]] = {
    "AuthKeyConfig": {"name": "k", "sha256": "0" * 64},
    "PluginConfig": {"path": "m:a"},
    "RedisStoreConfig": {"kind": "redis"},
    "HTTPProviderConfig": {"base_url": "https://up.example"},
    "OpenAIProviderConfig": {"kind": "openai"},
    "AnthropicProviderConfig": {"kind": "anthropic"},
}
"""What each table needs besides the key under test."""

"""Providers: the outbound edge. ``build_provider`` makes one from its config table."""

from __future__ import annotations

from ..config import ProviderConfig
from .base import Provider
from .mock import MockProvider

__all__ = ["MockProvider", "Provider", "build_provider"]

KINDS: dict[str, type[Provider]] = {"mock": MockProvider}


def build_provider(name: str, config: ProviderConfig) -> Provider:
    return KINDS[config.kind](name, models=config.models)

"""Providers: the outbound edge. ``build_provider`` makes one from its config table."""

from __future__ import annotations

import logging

from ..config import AnthropicProviderConfig, MockProviderConfig, OpenAIProviderConfig
from ..errors import ConfigError
from .anthropic import AnthropicProvider
from .base import Provider
from .http import resolve_api_key
from .mock import MockProvider
from .openai import OpenAIProvider

__all__ = ["AnthropicProvider", "MockProvider", "OpenAIProvider", "Provider", "build_provider"]

log = logging.getLogger("nexus.providers")


def build_provider(
    name: str, config: MockProviderConfig | OpenAIProviderConfig | AnthropicProviderConfig
) -> Provider | None:
    """The provider a config table describes; None for an optional one without its key."""
    if isinstance(config, MockProviderConfig):
        return MockProvider(name, models=config.models)
    try:
        key = resolve_api_key(name, config)
    except ConfigError:
        if not config.optional:
            raise
        log.warning(
            "provider %r left out: the environment variable %s is not set (optional = true)",
            name,
            config.api_key_env,
        )
        return None
    if isinstance(config, OpenAIProviderConfig):
        return OpenAIProvider(name, config, key)
    return AnthropicProvider(name, config, key)

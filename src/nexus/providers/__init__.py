"""Providers: the outbound edge. ``build_provider`` makes one from its config table."""

from __future__ import annotations

import logging
import os

from ..config import AnthropicProviderConfig, MockProviderConfig, OpenAIProviderConfig
from ..config_errors import in_file
from ..errors import ConfigError
from .anthropic import AnthropicProvider
from .base import Provider
from .mock import MockProvider
from .openai import OpenAIProvider

__all__ = ["AnthropicProvider", "MockProvider", "OpenAIProvider", "Provider", "build_provider"]

log = logging.getLogger("nexus.providers")


def build_provider(
    name: str,
    config: MockProviderConfig | OpenAIProviderConfig | AnthropicProviderConfig,
    source: str | None = None,
) -> Provider | None:
    """The provider a config table describes, with its key from ``api_key_env``; None for
    an optional one whose variable is unset, :class:`ConfigError` naming it (and the file,
    ``source``, when given) for another."""
    if isinstance(config, MockProviderConfig):
        return MockProvider(name, models=config.models)
    key = os.environ.get(config.api_key_env) if config.api_key_env else None
    key = key.strip() if key else key  # (a secret read from a file ends with a newline)
    if config.api_key_env and not key:
        # Its name is not repeated: a key put there by mistake looks like a name too.
        unset = "the environment variable it names is not set (or holds only spaces)"
        if not config.optional:
            raise ConfigError(
                in_file(
                    f"[providers.{name}] api_key_env: {unset} "
                    "(set it, or mark the provider optional = true)",
                    source,
                )
            )
        log.warning("provider %r left out: api_key_env: %s (optional = true)", name, unset)
        return None
    try:
        if isinstance(config, OpenAIProviderConfig):
            return OpenAIProvider(name, config, key)
        return AnthropicProvider(name, config, key)
    except ValueError as exc:  # a setting that cannot be used (ca_file)
        raise ConfigError(in_file(f"[providers.{name}] {exc}", source)) from None

"""``kind = "anthropic"``: the Anthropic Messages API, with ``x-api-key`` and
``anthropic-version``; the codec is :mod:`nexus.protocol.anthropic_events`."""

from __future__ import annotations

from typing import Any

from ..config import AnthropicProviderConfig
from ..errors import InvalidRequest
from ..protocol.anthropic_betas import sent_betas
from ..protocol.anthropic_count import CountDecoder, count_body
from ..protocol.anthropic_events import EventDecoder, messages_body, refusal
from ..request import ChatRequest
from .http import HTTPProvider

__all__ = ["AnthropicProvider"]


class AnthropicProvider(HTTPProvider):
    kind = "anthropic"
    accepts = frozenset({"text", "image"})
    path = "/v1/messages"
    config: AnthropicProviderConfig

    def __init__(
        self, name: str, config: AnthropicProviderConfig, api_key: str | None = None
    ) -> None:
        super().__init__(name, config, api_key)
        self._counter: _Counter | None = None

    @property
    def default_output_cap(self) -> int:  # type: ignore[override]
        return self.config.default_max_tokens

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        headers["anthropic-version"] = self.config.anthropic_version
        if self._api_key:
            headers["x-api-key"] = self._api_key
        return headers

    def request_headers(self, request: ChatRequest) -> dict[str, str] | None:
        asked = (request.model_extra or {}).get("anthropic_beta")
        betas = None if asked is None else sent_betas(asked, self.config.betas)
        return None if betas is None else {"anthropic-beta": betas}

    def refusal(self, request: ChatRequest) -> InvalidRequest | None:
        return refusal(request)

    def upstream(self, request: ChatRequest, model: str) -> tuple[dict[str, Any], EventDecoder]:
        body = messages_body(request, model, self.config.default_max_tokens)
        return body, EventDecoder(self.name, self.config.max_event_bytes)

    def counter(self) -> HTTPProvider:
        """This provider's ``count_tokens``: the same pool, key, betas and deadlines."""
        counter = self._counter
        if counter is None:
            counter = self._counter = _Counter(self)
        counter._pool = self._pool
        return counter


class _Counter(AnthropicProvider):
    """``POST /v1/messages/count_tokens`` of an Anthropic provider (its answer is JSON)."""

    path = "/v1/messages/count_tokens"

    def __init__(self, provider: AnthropicProvider) -> None:
        super().__init__(provider.name, provider.config, provider._api_key)
        self._watchdog = provider._watchdog

    def upstream(self, request: ChatRequest, model: str) -> tuple[dict[str, Any], CountDecoder]:  # type: ignore[override]
        return count_body(request, model), CountDecoder(self.name, self.config.max_event_bytes)

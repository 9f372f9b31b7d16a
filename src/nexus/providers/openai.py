"""``kind = "openai"``: any OpenAI-compatible Chat Completions server; the codec is
:mod:`nexus.protocol.openai_request` and :mod:`nexus.protocol.openai_chunks`."""

from __future__ import annotations

from typing import Any

from ..config import OpenAIProviderConfig
from ..errors import InvalidRequest
from ..protocol.openai_chunks import ChunkDecoder
from ..protocol.openai_request import refusal, upstream_body
from ..request import ChatRequest
from .http import HTTPProvider

__all__ = ["OpenAIProvider"]


class OpenAIProvider(HTTPProvider):
    kind = "openai"
    accepts = frozenset({"text", "image", "audio"})
    path = "/chat/completions"
    config: OpenAIProviderConfig

    def __init__(self, name: str, config: OpenAIProviderConfig, api_key: str | None = None) -> None:
        super().__init__(name, config, api_key)

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        if self._api_key:
            if self.config.api_key_header == "api-key":  # Azure OpenAI's
                headers["api-key"] = self._api_key
            else:
                headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def refusal(self, request: ChatRequest) -> InvalidRequest | None:
        return refusal(request)

    def upstream(self, request: ChatRequest, model: str) -> tuple[dict[str, Any], ChunkDecoder]:
        body = upstream_body(request, model, self.config.token_limit_field)
        return body, ChunkDecoder(self.name, self.config.max_event_bytes)

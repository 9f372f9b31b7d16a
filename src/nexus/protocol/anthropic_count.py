"""Anthropic's ``count_tokens``: the request, and its answer read. Sans-I/O.

Claude Code asks ``POST /v1/messages/count_tokens`` for the size of its context before it
sends it (what ``/context`` shows, and when it compacts). Anthropic answers it exactly and
for free; :func:`count_body` is a Messages request as that endpoint takes it, and
:class:`CountDecoder` reads its JSON answer (``{"input_tokens": N}``) as a
:class:`~nexus.events.Usage`, through the same upstream client as a stream.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from ..errors import UpstreamError, UpstreamProtocolError
from ..events import StreamEvent, Usage
from ..request import ChatRequest
from .anthropic_events import messages_body
from .upstream import in_stream_error, object_of, token_count

__all__ = ["COUNTED", "CountDecoder", "count_body"]

COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config")
"""The fields of a Messages request that ``count_tokens`` takes (the rest shape the answer,
not the prompt: its length, sampling, streaming)."""


def count_body(request: ChatRequest, model: str) -> dict[str, Any]:
    """The ``count_tokens`` request for ``request``'s prompt. Raises as :func:`messages_body`."""
    body = messages_body(request, model, 1)
    return {key: body[key] for key in COUNTED if key in body}


class CountDecoder:
    """The JSON answer of ``count_tokens`` (an :class:`~.upstream.UpstreamDecoder`): its
    ``input_tokens`` as a usage, once the body has ended whole."""

    terminator: ClassVar[str] = "the end of its JSON answer"
    answers_json: ClassVar[bool] = True  # (a stream's decoder takes a JSON answer for an error)

    def __init__(self, provider: str, max_bytes: int) -> None:
        self._provider = provider
        self._max = max_bytes
        self._body = bytearray()
        self.done = False
        self.error: UpstreamError | None = None
        self.response_model: str | None = None

    def decode(self, chunk: bytes) -> list[StreamEvent]:
        self._body += chunk
        if len(self._body) > self._max:
            self.error = UpstreamProtocolError(
                f"provider {self._provider!r} sent a count_tokens answer past {self._max} bytes"
            )
        return []

    def closed(self) -> list[StreamEvent]:
        try:
            answer = object_of(orjson.loads(self._body), "count_tokens answer")
            if isinstance(error := answer.get("error"), dict):  # (a 200 with an error body)
                self.error = in_stream_error(self._provider, error)
                return []
            if "input_tokens" not in answer:
                raise ValueError("it has no input_tokens")
            tokens = token_count(answer.get("input_tokens"), "input_tokens")
        except (orjson.JSONDecodeError, ValueError) as exc:
            self.error = UpstreamProtocolError(
                f"provider {self._provider!r} sent a count_tokens answer that is not one: {exc}"
            )
            return []
        self.done = True
        return [Usage(tokens, 0, tokens)]

    def cut(self) -> list[StreamEvent]:
        return []

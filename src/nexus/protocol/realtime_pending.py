"""Realtime input held before a ``start``: what it counts for, per connection and per
key, and how it joins the start's request. Sans-I/O.

Kept apart from the session (:mod:`nexus.protocol.realtime`), which decides what to
hold: this is how it is held. Audio is held decoded, an image as its URL, each new
item counted :data:`PENDING_ITEM_BYTES` more; all of a key's connections together
hold at most a :class:`PendingLedger`'s limit.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from ..request import (
    AudioPart,
    ChatRequest,
    ContentPart,
    ImagePart,
    TextPart,
    UserMessage,
)

__all__ = ["PENDING_ITEM_BYTES", "PendingAudio", "PendingLedger", "attach", "to_part"]


PENDING_ITEM_BYTES = 1024
"""What a pending item counts for beyond its data: about what it costs in memory, so
that empty images or tiny chunks cannot pile up uncounted."""


class PendingLedger:
    """The pending input of every connection of a process, per key: one key's sockets
    together hold at most ``limit`` bytes (``[realtime] max_pending_bytes_per_key``), so
    what a key can pin in memory is bounded however many sockets it opens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def held(self, owner: str) -> int:
        return self._held.get(owner, 0)

    def take(self, owner: str, size: int) -> bool:
        held = self._held.get(owner, 0) + size
        if held > self.limit:
            return False
        self._held[owner] = held
        return True

    def give(self, owner: str, size: int) -> None:
        held = self._held.get(owner, 0) - size
        if held > 0:
            self._held[owner] = held
        else:
            self._held.pop(owner, None)


@dataclass(slots=True)
class PendingAudio:
    """Audio held for the next ``start``: consecutive ``pcm16`` chunks of one rate join."""

    format: str
    sample_rate: int
    data: bytearray


def to_part(item: ImagePart | PendingAudio) -> ContentPart:
    if isinstance(item, ImagePart):
        return item
    audio: dict[str, Any] = {"data": base64.b64encode(item.data).decode(), "format": item.format}
    if item.format == "pcm16":
        audio["sample_rate"] = item.sample_rate
    return AudioPart.model_validate({"type": "input_audio", "input_audio": audio})


def attach(request: ChatRequest, parts: list[ContentPart]) -> ChatRequest:
    """A copy of ``request`` whose last user message also holds ``parts``."""
    messages = list(request.messages)
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, UserMessage):
            content = message.content
            existing: list[ContentPart] = (
                [TextPart(type="text", text=content)] if isinstance(content, str) else list(content)
            )
            messages[i] = message.model_copy(update={"content": existing + parts})
            break
    else:
        messages.append(UserMessage(role="user", content=parts))
    return request.model_copy(update={"messages": messages})

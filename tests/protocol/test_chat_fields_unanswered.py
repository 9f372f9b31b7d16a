"""A chat field whose answer comes back in a response field Nexus has no event for is
refused by name: ``moderation`` reached the upstream, which answered with moderation
results on a chunk of their own, and the client got ``moderation: null`` on every chunk
and on the completion, without a word."""

from __future__ import annotations

import orjson

from nexus.protocol.openai_chat import parse_chat_request
from nexus.protocol.openai_request import refusal

BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_moderation_is_refused_by_name_by_an_openai_target() -> None:
    """Refused where a request meets its target, so on every surface: HTTP, the
    WebSocket's start and the Python API (an Anthropic target refuses unknown fields)."""
    asked = parse_chat_request(orjson.dumps(BODY | {"moderation": {"model": "omni"}}))
    refused = refusal(asked)
    assert refused is not None and (refused.param, refused.status) == ("moderation", 400)
    assert refusal(parse_chat_request(orjson.dumps(BODY | {"moderation": None}))) is None

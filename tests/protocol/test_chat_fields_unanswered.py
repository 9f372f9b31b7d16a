"""A chat field whose answer comes back in a response field Nexus has no event for is
refused by name: ``moderation`` reached the upstream, which answered with moderation
results on a chunk of their own, and the client got ``moderation: null`` on every chunk
and on the completion, without a word."""

from __future__ import annotations

import orjson
import pytest

from nexus.errors import InvalidRequest
from nexus.protocol.openai_chat import parse_chat_request

BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_moderation_is_refused_by_name() -> None:
    asked = BODY | {"moderation": {"model": "omni-moderation-latest"}}
    with pytest.raises(InvalidRequest) as refused:
        parse_chat_request(orjson.dumps(asked))
    assert refused.value.param == "moderation"
    assert refused.value.status == 400
    assert parse_chat_request(orjson.dumps(BODY | {"moderation": None})).model == "m"

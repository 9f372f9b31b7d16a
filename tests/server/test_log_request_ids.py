"""A line logged while a request is served carries its id (the JSON format writes it): the
upstream's own text of a 5xx, which goes to the log and not to the client, was found by no
request id, so an operator holding the ``req_...`` of a 502 could not find why."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from nexus.server.log_lines import JsonFormatter, RequestIds
from support import MakeClient
from upstreams import FakeUpstream, Reply


async def test_an_upstream_s_error_text_is_logged_with_the_request_id(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nexus")
    caplog.handler.addFilter(RequestIds())  # as nexus serve's handler has it
    body = {"error": {"message": "the upstream's own words", "type": "server_error"}}
    async with FakeUpstream(Reply.json(500, body)) as fake:
        config: dict[str, Any] = {"providers": {"up": {"kind": "openai", "base_url": fake.url}}}
        client = await make_client(config)
        chat = {"model": "up/m", "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post("/v1/chat/completions", json=chat)
        assert resp.status == 502
    request_id = resp.headers["X-Request-Id"]
    (record,) = [r for r in caplog.records if "the upstream's own words" in r.getMessage()]
    assert record.request_id == request_id  # type: ignore[attr-defined]
    assert f'"request_id":"{request_id}"' in JsonFormatter().format(record)

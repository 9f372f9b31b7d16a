"""A line logged while a request is served carries its id (the JSON format writes it): the
upstream's own text of a 5xx, which goes to the log and not to the client, was found by no
request id, so an operator holding the ``req_...`` of a 502 could not find why."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from nexus.log_context import RequestIds
from nexus.server.log_lines import JsonFormatter
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


async def test_a_task_a_request_starts_for_everyone_is_no_one_s() -> None:
    """The watchdog, a DNS lookup, a Redis flush: started lazily by whichever request came
    first, they serve everyone. A context variable named that request on their lines (a
    write timeout of request B logged as request A's); only the run inherits its id."""
    import asyncio

    from nexus.log_context import inherit, serve

    records: list[logging.LogRecord] = []
    ids = RequestIds()

    async def log(name: str) -> None:
        record = logging.LogRecord(name, logging.WARNING, __file__, 1, name, None, None)
        ids.filter(record)
        records.append(record)

    async def request() -> None:
        serve("req_A")
        await log("handler")
        shared = asyncio.get_running_loop().create_task(log("shared"))
        run = asyncio.get_running_loop().create_task(log("run"))
        inherit(run)
        await asyncio.gather(shared, run)

    await asyncio.get_running_loop().create_task(request())
    got = {r.name: getattr(r, "request_id", None) for r in records}
    assert got == {"handler": "req_A", "shared": None, "run": "req_A"}

"""A client's own key, put where the access line quotes it (its request id, the URL path,
the model), is not logged: the line gets the same redaction as aiohttp's loggers, in its
text and in the fields the JSON format writes."""

from __future__ import annotations

import logging

import orjson
import pytest

from nexus.auth import new_key
from nexus.server.log_lines import JsonFormatter, line
from support import MakeClient

KEY = new_key()


async def test_a_key_in_the_request_id_or_path_is_not_logged(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client()
    with caplog.at_level(logging.INFO, logger="nexus.access"):
        given = await client.get("/v1/models", headers={"X-Request-Id": KEY})
        assert given.headers["X-Request-Id"] != KEY  # a new id, not the key
        lost = await client.get(f"/v1/streams/{KEY}")
        assert lost.status == 404
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": KEY, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status == 404
    records = [r for r in caplog.records if r.name == "nexus.access"]
    assert len(records) == 3
    for record in records:
        assert KEY not in record.getMessage()
        assert KEY not in JsonFormatter().format(record)
    paths = [orjson.loads(JsonFormatter().format(r))["path"] for r in records]
    assert paths[1] == "/v1/streams/nx-[redacted]"


async def test_a_key_sent_as_a_realtime_model_is_not_logged(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client = await make_client()
    async with client.ws_connect("/v1/realtime") as ws:
        request = {"model": KEY, "messages": [{"role": "user", "content": "x"}]}
        await ws.send_json({"type": "start", "request": request})
        refused = await ws.receive_json()
        assert refused["error"]["code"] == "model_not_found"
    warnings = [r.getMessage() for r in caplog.records if "start refused" in r.getMessage()]
    assert len(warnings) == 1
    assert KEY not in warnings[0] and "nx-[redacted]" in warnings[0]


def test_a_credential_a_quote_would_hide_is_redacted_in_both_formats() -> None:
    """Quoted for the text line, ``"\\nBearer <token>"`` loses the word boundary the
    patterns need; the check runs on the values as they are."""
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("nexus.test.redaction")
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        line(logger, logging.WARNING, "req_1", {"path": "/v1/x\nBearer sk-live-SECRET", "n": 1})
    finally:
        logger.removeHandler(handler)
    (record,) = records
    assert "SECRET" not in record.getMessage()
    assert "SECRET" not in JsonFormatter().format(record)

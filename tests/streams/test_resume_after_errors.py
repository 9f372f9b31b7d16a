"""A resume of a stream whose client already got 200 must not turn into an HTTP error.

The origin waited ``heartbeat_interval_s`` for output, sent its headers and the
first frame (``id: <stream>.0``), then the provider failed (in-band). A client
that saw ``<stream>.0`` and resumes gets HTTP 502 JSON, because the pump's
"failed before any output" test is ``renderer.step == 0`` (streaming.py), which
also holds for every resume, rather than "this client has seen nothing".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from nexus import Provider
from nexus.errors import UpstreamError
from nexus.events import StreamEvent
from nexus.request import ChatRequest
from support import MakeClient, chat, parse_sse


class Late(Provider):
    kind = "late"

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        await asyncio.sleep(0.4)
        raise UpstreamError("upstream broke")
        yield []  # pragma: no cover


async def test_a_resume_after_the_first_frame_gets_the_error_in_band(
    make_client: MakeClient,
) -> None:
    client = await make_client({"server": {"heartbeat_interval_s": 0.1}}, providers=[Late("late")])
    resp = await client.post("/v1/chat/completions", json=chat(model="late/x", stream=True))
    assert resp.status == 200
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    events = parse_sse(await resp.read())
    assert events[0].id == f"{stream_id}.0"
    assert any(e.event == "error" for e in events)
    resumed = await client.get(
        f"/v1/streams/{stream_id}", headers={"Last-Event-ID": f"{stream_id}.0"}
    )
    assert resumed.status == 200, await resumed.text()
    rest = parse_sse(await resumed.read())
    assert [e.event for e in rest] == ["error", "message"]

"""Readers that leave an idle stream must not leave their waiters behind.

``RunReader.__anext__`` appends a future to ``StreamRun._waiters`` and awaits it;
when the pump is cancelled (the client left) the cancelled future stays in the
list until the next event. On an idle stream (a slow upstream, an EventSource
reconnecting) every reconnect adds one.
"""

from __future__ import annotations

import asyncio

from nexus.server.state import HUB
from support import GatedProvider, MakeClient, chat


async def test_readers_that_leave_an_idle_stream_leave_no_waiters(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"streams": {"detach_timeout_s": 60}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions", json=chat(model="gated/m", stream=True, background=True)
    )
    stream_id = (await resp.json())["id"]
    for _ in range(50):
        attached = await client.get(f"/v1/streams/{stream_id}")
        await asyncio.wait_for(attached.content.readuntil(b"\n\n"), 5)
        attached.close()
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    run = client.app[HUB].live[stream_id]
    assert run.attached == 0
    try:
        assert len(run._waiters) == 0
    finally:
        gated.gate.set()

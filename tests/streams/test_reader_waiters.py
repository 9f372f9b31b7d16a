"""Readers that leave an idle stream must not leave their waiters behind.

``RunReader.__anext__`` appends a future to ``StreamRun._waiters`` and awaits it;
when the pump is cancelled (the client left) the cancelled future stays in the
list until the next event. On an idle stream (a slow upstream, an EventSource
reconnecting) every reconnect adds one.
"""

from __future__ import annotations

import asyncio

import pytest

from nexus.cache.readers import RunReader
from nexus.events import Delta
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


@pytest.mark.parametrize("cancel_first", [False, True], ids=["woken-then-cut", "cut-then-woken"])
async def test_a_read_cut_as_its_batch_arrives_finds_it_when_made_again(
    make_client: MakeClient, cancel_first: bool
) -> None:
    """The pump puts a deadline on its first read of a local run: the deadline's cancel
    and the batch's arrival can fall in one turn of the loop, either way round. The read
    made again returns the batch, once."""
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"streams": {"detach_timeout_s": 60}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions", json=chat(model="gated/m", stream=True, background=True)
    )
    run = client.app[HUB].live[(await resp.json())["id"]]
    await asyncio.sleep(0.05)  # the run waits at the gate, its log at its first event
    reader = RunReader(run, start=len(run.events))
    read = asyncio.ensure_future(anext(reader))
    await asyncio.sleep(0)  # the read waits on its future
    assert not read.done()
    batch = [Delta(content="racing ")]

    def arrive() -> None:  # what the run's producer does with a batch
        run.events.extend(batch)
        run._wake(batch)

    # One turn: both callbacks run before the read's task does.
    loop = asyncio.get_running_loop()
    if cancel_first:
        loop.call_soon(read.cancel)
        loop.call_soon(arrive)
    else:
        loop.call_soon(arrive)
        loop.call_soon(read.cancel)
    with pytest.raises(asyncio.CancelledError):
        await read
    assert await asyncio.wait_for(anext(reader), 1) == batch
    assert run._waiters == {}
    await reader.close()
    gated.gate.set()

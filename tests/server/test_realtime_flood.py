"""A realtime client sending frames as fast as it can: the loop keeps turning for the
others, its budget closes it (1008), and invalid frames cannot make the gateway write
without bound. Counted in loop turns, frames and close codes, never in seconds."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import orjson
import pytest
import websockets

from nexus.server.routes.realtime import RealtimeConnection
from support import MakeClient, access_record, masked, raw_socket, read_frame


class LoopTurns:
    """Counts the loop's turns (a task waking once per turn) and, for each frame the
    gateway receives, the turn it came in: frames that share a turn held the loop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.turns = 0
        self.seen: list[int] = []
        receive = RealtimeConnection._receive

        async def counted(conn: RealtimeConnection, message: Any) -> bool:
            self.seen.append(self.turns)
            return await receive(conn, message)

        monkeypatch.setattr(RealtimeConnection, "_receive", counted)
        self.task = asyncio.get_running_loop().create_task(self._count())

    async def _count(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.turns += 1

    def most_frames_in_one_turn(self) -> int:
        counts: dict[int, int] = {}
        for turn in self.seen:
            counts[turn] = counts.get(turn, 0) + 1
        return max(counts.values())


PINGS = 2000


async def test_a_flood_of_pings_lets_the_loop_turn_between_frames(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2000 pings in one write: aiohttp queues them all at once, and receive() returns each
    # without suspending. Each frame must still give the loop a turn.
    client = await make_client({"realtime": {"max_frames_per_second": 1_000_000}})
    turns = LoopTurns(monkeypatch)
    reader, writer = await raw_socket(client)
    writer.write(b"".join(masked(0x9, b"") for _ in range(PINGS)))
    try:
        for _ in range(PINGS):
            assert (await read_frame(reader))[0] == 0xA  # each answered with a pong
    finally:
        writer.close()
        turns.task.cancel()
    assert len(turns.seen) >= PINGS
    assert turns.most_frames_in_one_turn() <= 2


async def test_a_socket_over_its_frame_budget_is_closed_1008(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client({"realtime": {"max_frames_per_second": 5}})
    reader, writer = await raw_socket(client)
    writer.write(b"".join(masked(0x9, b"") for _ in range(500)))
    pongs = 0
    while (frame := await read_frame(reader))[0] == 0xA:
        pongs += 1
    writer.close()
    opcode, payload = frame
    assert opcode == 0x8
    assert int.from_bytes(payload[:2], "big") == 1008
    assert payload[2:] == b"over 5 frames per second"
    assert pongs < 100  # five at once, a few more as the bucket refills: never the 500
    line = (await access_record(caplog)).access  # type: ignore[attr-defined]
    assert line["outcome"] == "cancelled:policy_violation"


async def test_a_socket_over_its_byte_budget_is_closed_1008(make_client: MakeClient) -> None:
    # Any one message of max_message_bytes (or all the input a socket may hold pending)
    # fits an idle socket; the next ones do not.
    client = await make_client(
        {
            "realtime": {
                "max_bytes_per_second": 1000,
                "max_message_bytes": 4000,
                "max_pending_input_bytes": 4000,
            }
        }
    )
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url, max_size=None) as ws:
        audio = base64.b64encode(b"\0" * 2900).decode()  # about 3900 bytes a frame
        envelope = orjson.dumps({"type": "audio_chunk", "format": "pcm16", "b64": audio})
        assert len(envelope) < 4000
        for _ in range(50):
            await ws.send(envelope.decode())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1008
    assert closed.value.rcvd.reason == "over 1000 bytes per second"


async def test_invalid_frames_in_a_row_are_answered_a_bounded_number_of_times(
    make_client: MakeClient,
) -> None:
    # Each error frame is far larger than an `x`: after max_invalid_frames of them in a
    # row, the socket is closed instead of answering the rest.
    client = await make_client({"realtime": {"max_invalid_frames": 4}})
    reader, writer = await raw_socket(client)
    writer.write(masked(0x1, b"x") * 3 + masked(0x9, b"") + masked(0x1, b"x") * 1000)
    errors = []
    while (frame := await read_frame(reader))[0] != 0x8:
        if frame[0] == 0x1:
            errors.append(orjson.loads(frame[1])["error"]["code"])
    writer.close()
    # A ping between two invalid frames does not break the run: it is no envelope.
    assert errors == ["invalid_envelope"] * 4
    assert int.from_bytes(frame[1][:2], "big") == 1008
    assert frame[1][2:] == b"4 invalid frames in a row"


async def test_a_peer_that_never_answers_the_policy_close_is_disconnected(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp would read such a peer's frames for its whole close timeout (10 s); the
    # gateway waits POLICY_CLOSE_WAIT_S (here 0.05 s) for the close frame, then closes.
    monkeypatch.setattr("nexus.server.routes.realtime.POLICY_CLOSE_WAIT_S", 0.05)
    client = await make_client({"realtime": {"max_frames_per_second": 5}})
    reader, writer = await raw_socket(client)
    writer.write(b"".join(masked(0x9, b"") for _ in range(50)))
    while (await read_frame(reader))[0] != 0x8:
        pass
    # No close frame back: the connection ends anyway, long before aiohttp's 10 s.
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()

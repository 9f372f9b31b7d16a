"""``[server] write_timeout_s`` on ``/v1/realtime``: a reader that is slow but reads is kept.

The drop of a client that reads nothing (while it pings) is tested on a real
process in ``test_limits_process.py``; here, the other side of the bound: a
client whose socket stays paused most of the time, because it reads more
slowly than the turn writes, takes bytes at every tick and gets its whole turn,
however much longer than ``write_timeout_s`` the turn takes.
"""

from __future__ import annotations

import asyncio
import socket

import orjson
import websockets

from nexus.server.state import RUNTIME
from support import MakeClient
from upstreams import FakeUpstream, Reply, openai_chunk


async def test_a_slow_reader_outlives_the_write_timeout(make_client: MakeClient) -> None:
    tokens = [f"{i:04d} " + "x" * 4090 for i in range(300)]  # 1.2 MB
    pieces = [
        b"".join(openai_chunk(content=t) for t in tokens[i : i + 50])
        for i in range(0, len(tokens), 50)
    ]
    pieces.append(openai_chunk(finish_reason="stop") + b"data: [DONE]\n\n")
    async with FakeUpstream(Reply.stream(pieces)) as upstream:
        provider = {"kind": "openai", "base_url": upstream.url + "/v1"}
        client = await make_client(
            {"providers": {"up": provider}, "server": {"write_timeout_s": 0.3}}
        )
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((client.server.host, client.server.port))
        sock.setblocking(False)
        async with websockets.connect(
            url, sock=sock, max_size=None, max_queue=1, compression=None
        ) as ws:
            (conn,) = client.app[RUNTIME].sockets
            server_sock = conn.request.transport.get_extra_info("socket")
            server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            request = {"model": "up/m", "messages": [{"role": "user", "content": "go"}]}
            await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
            loop = asyncio.get_running_loop()
            began = loop.time()
            paused = 0
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 5)))
                paused += conn.paused
                await asyncio.sleep(0.004)  # ~1 MB/s: slower than the turn writes
            took = loop.time() - began
    contents = [f["delta"]["content"] for f in frames if f["type"] == "delta" and f["delta"]]
    assert contents == tokens
    assert frames[-1] == {"type": "done"}
    assert took > 3 * 0.3, took  # many write timeouts long
    assert paused > len(frames) / 2, "the socket was paused most of the time"

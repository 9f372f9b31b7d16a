"""Backpressure on a real ``nexus serve`` process: clients that stop reading, or read slowly.

The gateway runs as a subprocess so that its resident memory can be read from
``/proc/<pid>/status`` (``VmRSS``), sampled every 50 ms by a thread for the whole
scenario. Clients are raw TCP sockets (``asyncio.open_connection``): a client
that "reads nothing" never calls ``recv`` until the assertions about it are made.

How the mock is made to produce a lot from a small request: without a script the
mock echoes its input, so output is at most a constant times the request. The
cheapest amplifier is a tool call: ``"mock": {"tool_calls": [{"name": "f",
"arguments": "aaaa…"}]}`` streams the arguments in 8-character fragments, and
each fragment is one ~230-byte OpenAI SSE frame (about 29x the input), produced
lazily (unlike ``content``, whose words are split into one list up front, which
would make the mock's own memory dominate the measurement). 8 MiB of arguments
ask for 1,048,576 fragments, about 240 MB of SSE.

Some scenarios shrink the client's kernel buffers (``SO_RCVBUF`` 4 KiB and an
advertised MSS of 1000 bytes, which also keeps the server's send buffer from
autotuning to megabytes): on loopback the kernel otherwise absorbs 4-6 MB of a
stream, which would hide what the gateway itself does with a reader that is
slow or stalled. With them the kernel holds about 100 KB.

One scenario is the opposite, in process: a reader as fast as the socket (curl) catching
up on a long log, which must not keep the event loop from the gateway's other tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from nexus_process import start_nexus, stop_nexus

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status and uses TCP_MAXSEG"
)

_SERVING = re.compile(r"Nexus serving on http://([\d.]+):(\d+)")
MiB = 1024 * 1024

WRITE_TIMEOUT_S = 1.0
DETACH_TIMEOUT_S = 1.0
MAX_LOG_BYTES = 32 * MiB  # the default, stated so that the bound below can be derived from it


def config(*, detach_timeout_s: float = DETACH_TIMEOUT_S) -> str:
    return f"""\
[server]
write_timeout_s = {WRITE_TIMEOUT_S}
heartbeat_interval_s = 15
shutdown_grace_s = 1

[streams]
detach_timeout_s = {detach_timeout_s}
max_log_bytes = {MAX_LOG_BYTES}

[providers.mock]
kind = "mock"
"""


# --- the server and its memory ---------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serve(tmp_path: Path, config_text: str) -> Iterator[Server]:
    """``nexus serve`` on a free port with ``config_text``; SIGTERM (then kill) at the end."""
    config = tmp_path / "config.toml"
    config.write_text(config_text)
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(config, log, ready=_SERVING)
    try:
        yield Server(proc, match.group(1), int(match.group(2)), log)
    finally:
        stop_nexus(proc)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with serve(tmp_path, config()) as running:
        yield running


@dataclass
class RssSampler:
    """Samples the server's RSS every 50 ms in a thread, from start() to stop()."""

    server: Server
    samples: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, AssertionError):
                self.samples.append((time.monotonic(), self.server.rss()))
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def peak(self) -> int:
        return max(rss for _, rss in self.samples)


async def settled_rss(server: Server) -> int:
    """The server's RSS once it is idle and warm (one request served)."""
    async with aiohttp.ClientSession() as http, http.get(server.url + "/healthz") as resp:
        assert resp.status == 200
    await asyncio.sleep(0.3)
    return server.rss()


async def health(http: aiohttp.ClientSession, server: Server) -> dict[str, object]:
    async with http.get(server.url + "/healthz") as resp:
        return await resp.json()  # type: ignore[no-any-return]


# --- raw clients -----------------------------------------------------------------------------


def tool_call_body(arguments: int, **mock: object) -> bytes:
    """A streaming request whose mock answer is one tool call of ``arguments`` characters."""
    script = {"content": "", "tool_calls": [{"name": "f", "arguments": "a" * arguments}], **mock}
    return orjson.dumps(
        {
            "model": "mock/echo",
            "stream": True,
            "messages": [{"role": "user", "content": "go"}],
            "mock": script,
        }
    )


@contextlib.asynccontextmanager
async def raw_client(
    server: Server, *, small_buffers: bool
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if small_buffers:  # before connect: they decide the advertised window and MSS
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1000)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
    except BaseException:
        sock.close()
        raise
    # A small limit: the StreamReader's own buffer must not absorb the stream either.
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def send(writer: asyncio.StreamWriter, method: str, path: str, body: bytes = b"") -> None:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()


async def read_rest(reader: asyncio.StreamReader, timeout: float = 10) -> bytes:
    """Whatever the connection still delivers, until EOF or a reset."""
    out = bytearray()
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(1 << 16):
                out += chunk
    return bytes(out)


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """``(head, body)`` of an HTTP/1.1 chunked response; raises if it is incomplete."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return head, bytes(body)
        assert len(rest) >= size + 2, "truncated chunk"
        body += rest[:size]
        rest = rest[size + 2 :]


def stream_id(raw: bytes) -> str:
    match = re.search(rb"X-Nexus-Stream-Id: (\S+)", raw, re.IGNORECASE)
    assert match, raw[:500]
    return match.group(1).decode()


@dataclass
class Timeline:
    attached: float | None = None  # healthz first shows our stream and its client
    dropped: float | None = None  # then no client
    gone: float | None = None  # then no stream


async def follow_health(server: Server, until: float, *, live: int = 1) -> Timeline:
    """Poll /healthz every 50 ms until the client came and went and no stream runs.

    ``live``: the streams running while the client is attached (0 for a finished log).
    """
    timeline = Timeline()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until and timeline.gone is None:
            state = await health(http, server)
            now = time.monotonic()
            if timeline.attached is None:
                if state["streams"] == live and state["clients"] == 1:
                    timeline.attached = now
            elif timeline.dropped is None and state["clients"] == 0:
                timeline.dropped = now
            if timeline.dropped is not None and state["streams"] == 0:
                timeline.gone = now
            await asyncio.sleep(0.05)
    return timeline


async def final_status(server: Server, sid: str) -> str:
    """The status of a finished stream (``DELETE`` of a finished stream only describes it)."""
    async with aiohttp.ClientSession() as http, http.delete(server.url + f"/v1/streams/{sid}") as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["status"])


# --- clients that read nothing ---------------------------------------------------------------


async def test_client_that_stops_reading_is_dropped_and_its_stream_cancelled_after_detach(
    server: Server,
) -> None:
    """A paced stream (about 1,000 frames/s, 20 s long) and a client that reads nothing.

    Once the ~100 KB that the kernel holds are full, the gateway's write stalls: it
    must drop the client ``write_timeout_s`` later, and, no client being attached,
    cancel the stream ``detach_timeout_s`` after that (status ``cancelled``: the log
    ends with ``stream_detached``), long before the stream would have ended.
    """
    async with raw_client(server, small_buffers=True) as (reader, writer):
        body = orjson.dumps(
            {
                "model": "mock/echo",
                "stream": True,
                "messages": [{"role": "user", "content": "go"}],
                "mock": {"content": "a " * 20_000, "delay_ms": 1},
            }
        )
        sent = time.monotonic()
        await send(writer, "POST", "/v1/chat/completions", body)
        timeline = await follow_health(server, until=sent + 12)
        # Checked before reading: a client never dropped would leave the read waiting.
        assert timeline.attached is not None, "the stream never showed in /healthz"
        assert timeline.dropped is not None, "the client that read nothing was never dropped"
        assert timeline.gone is not None, "the stream was never cancelled"
        raw = await read_rest(reader)  # only now: what the kernel held, then EOF or a reset

    # The ~100 KB the kernel holds fill in ~1 s (~1,000 frames/s of SSE), then the write
    # stalls for write_timeout_s; the watchdog notices within a quarter of it.
    assert WRITE_TIMEOUT_S <= timeline.dropped - sent <= WRITE_TIMEOUT_S + 3.0
    assert timeline.gone - timeline.dropped <= DETACH_TIMEOUT_S + 1.0
    assert timeline.gone - sent < 8  # the stream itself would run for 20 s
    print(
        f"dropped {timeline.dropped - sent:.2f}s after the request, "
        f"stream gone {timeline.gone - timeline.dropped:.2f}s later"
    )
    sid = stream_id(raw)
    assert f"dropping client of stream {sid}: a write stalled" in server.log_text()
    assert b"data: [DONE]" not in raw  # cut short, not finished
    assert await final_status(server, sid) == "cancelled"


async def test_memory_stays_bounded_while_the_mock_produces_100_mb_for_a_client_that_reads_nothing(
    server: Server,
) -> None:
    """The mock is asked for ~240 MB of SSE; the client reads nothing; RSS stays bounded.

    Stated bound: peak RSS <= baseline + 160 MiB (5 x ``max_log_bytes``), sampled
    every 50 ms from the request until the stream is gone. Why that much:

    * the stream's log is what holds memory here: the producer does not wait for
      clients (streams outlive connections), so until the client is dropped
      (``write_timeout_s``) and the stream cancelled (``detach_timeout_s``) later,
      the log grows at the mock's full speed (~190k fragments/s on a 2-core
      machine, i.e. ~45 MB/s of SSE). What bounds it whatever the speed is
      ``[streams] max_log_bytes`` (32 MiB) -- in the log's *accounted* bytes, 52 per
      8-byte fragment, while each fragment costs ~162 bytes of Python objects (the
      event, its string, its offset, list slots): at most ~100 MiB of objects;
    * the 8 MiB request body, held while read, parsed and validated and by the
      mock: ~32 MiB;
    * what waits for the socket: one batch (<= 256 events, ~60 KB) in aiohttp's
      buffer; the kernel's socket buffers are not in the process's RSS;
    * ~28 MiB for allocator slack.

    Had the mock been allowed to run to the end (1,048,576 fragments), the log alone
    would be ~170 MiB of objects, over the bound. Measured on the development
    machine: the client dropped 1.2 s after the request, the stream cancelled
    (``stream_detached``) 1.3 s later after ~450k fragments (~105 MB of SSE), peak
    RSS baseline (52 MiB) + 89 to 97 MiB.
    """
    baseline = await settled_rss(server)
    sampler = RssSampler(server)
    sampler.start()
    try:
        async with raw_client(server, small_buffers=False) as (reader, writer):
            sent = time.monotonic()
            await send(writer, "POST", "/v1/chat/completions", tool_call_body(8 * MiB))
            timeline = await follow_health(server, until=sent + 10)
            raw = await read_rest(reader)
    finally:
        sampler.stop()

    assert timeline.attached is not None, "the stream never showed in /healthz"
    assert timeline.dropped is not None, "the client that read nothing was never dropped"
    assert timeline.gone is not None, "the stream was never ended"
    # Generous margins: the machine is shared, and /healthz is polled, not pushed.
    assert WRITE_TIMEOUT_S <= timeline.dropped - sent <= WRITE_TIMEOUT_S + 4.0
    assert timeline.gone - timeline.dropped <= DETACH_TIMEOUT_S + 4.0
    sid = stream_id(raw)
    assert f"dropping client of stream {sid}: a write stalled" in server.log_text()
    assert b"data: [DONE]" not in raw
    # Ended by the gateway: detached (cancelled), or, on a machine fast enough to reach
    # the log cap first, stream_too_large (failed); never completed.
    assert await final_status(server, sid) in ("cancelled", "failed")
    growth = sampler.peak - baseline
    print(
        f"baseline {baseline / MiB:.1f} MiB, peak {sampler.peak / MiB:.1f} MiB "
        f"(+{growth / MiB:.1f}); dropped {timeline.dropped - sent:.2f}s after the request, "
        f"stream gone {timeline.gone - timeline.dropped:.2f}s later"
    )
    assert len(sampler.samples) > 20
    assert growth <= 5 * MAX_LOG_BYTES, (
        f"RSS grew by {growth / MiB:.1f} MiB over a baseline of {baseline / MiB:.1f} MiB"
    )


async def test_a_reader_that_attaches_to_a_long_log_and_reads_nothing_costs_bounded_memory(
    tmp_path: Path,
) -> None:
    """``GET /v1/streams/{id}`` of a finished 262,144-fragment log (~60 MB of SSE), read by
    nobody: the client is dropped after ``write_timeout_s``, and meanwhile the gateway
    holds at most a bounded write buffer for it.

    Stated bound: peak RSS <= (RSS once the log is finished) + 32 MiB. A per-connection
    buffer does not need more: the log is already in memory and is what is replayed;
    the pump need only render and write it in bounded slices as the socket takes them.
    Before the pump rendered backlogs in slices (``MAX_BATCH`` events, ``WRITE_SLICE``
    bytes per write) this was +175 to +225 MiB for a log of ~50 MiB; now about +0.
    (``detach_timeout_s = 10`` here, so that the background stream runs to its end.)
    """
    with serve(tmp_path, config(detach_timeout_s=10)) as server:
        await _attach_to_a_long_log_and_read_nothing(server)


async def _attach_to_a_long_log_and_read_nothing(server: Server) -> None:
    async with aiohttp.ClientSession() as http:
        body = orjson.loads(tool_call_body(2 * MiB))
        body["background"] = True
        async with http.post(
            server.url + "/v1/chat/completions",
            data=io.BytesIO(orjson.dumps(body)),  # raw bytes this big warn (ResourceWarning)
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 202
            sid = (await resp.json())["id"]
        deadline = time.monotonic() + 10
        while (await health(http, server))["streams"] != 0:
            assert time.monotonic() < deadline, "the background stream did not finish"
            await asyncio.sleep(0.05)
    assert await final_status(server, sid) == "completed"
    await asyncio.sleep(0.3)
    baseline = server.rss()

    sampler = RssSampler(server)
    sampler.start()
    try:
        async with raw_client(server, small_buffers=False) as (reader, writer):
            sent = time.monotonic()
            await send(writer, "GET", f"/v1/streams/{sid}")
            timeline = await follow_health(server, until=sent + 8, live=0)
            await read_rest(reader)
    finally:
        sampler.stop()

    assert timeline.dropped is not None, "the client that read nothing was never dropped"
    growth = sampler.peak - baseline
    print(f"RSS {baseline / MiB:.1f} MiB with the log kept, +{growth / MiB:.1f} for the attach")
    assert growth <= 32 * MiB, (
        f"RSS grew by {growth / MiB:.1f} MiB over {baseline / MiB:.1f} MiB for one attach"
    )


# --- a slow reader ---------------------------------------------------------------------------


SLOW_FRAGMENTS = 3_000  # ~850 KB of OpenAI SSE: ~9 s at 1 KB every 10 ms


@pytest.mark.parametrize(
    "small_buffers",
    [
        pytest.param(False, id="loopback-buffers"),
        pytest.param(True, id="small-buffers"),
    ],
)
async def test_a_slow_but_alive_reader_gets_the_whole_stream(
    server: Server, small_buffers: bool
) -> None:
    """A client that reads 1 KB every 10 ms (~100 KB/s) is never dropped.

    ``write_timeout_s`` (1 s) is for a client "whose socket takes no data for this
    long" (docs/configuration.md); this one's socket takes data every 10 ms. The mock produces
    the whole stream in milliseconds, so the gateway holds a backlog of ~850 KB
    for it. With loopback's kernel buffers the kernel takes all of it at once;
    with small ones (``small-buffers``) the gateway must feed the socket as it
    drains. The stream must arrive complete (every fragment, then ``[DONE]``) and
    RSS stay under baseline + 32 MiB (the whole stream is < 1 MB).
    """
    baseline = await settled_rss(server)
    sampler = RssSampler(server)
    sampler.start()
    raw = bytearray()
    try:
        async with raw_client(server, small_buffers=small_buffers) as (reader, writer):
            started = time.monotonic()
            await send(writer, "POST", "/v1/chat/completions", tool_call_body(8 * SLOW_FRAGMENTS))
            with contextlib.suppress(ConnectionError):
                async with asyncio.timeout(14):
                    while not raw.endswith(b"\r\n0\r\n\r\n"):
                        chunk = await reader.read(1024)
                        if not chunk:
                            break
                        raw += chunk
                        await asyncio.sleep(0.01)
            elapsed = time.monotonic() - started
    finally:
        sampler.stop()

    assert b"dropping client" not in server.log_text().encode()
    head, body = dechunk(bytes(raw))
    assert head.startswith(b"HTTP/1.1 200")
    assert body.endswith(b"data: [DONE]\n\n")
    arguments = "".join(
        call["function"]["arguments"]
        for frame in body.split(b"\n\n")
        if frame.startswith(b"id: ") and b"\ndata: {" in frame
        for choice in orjson.loads(frame.split(b"\ndata: ", 1)[1])["choices"]
        for call in choice["delta"].get("tool_calls", ())
    )
    assert arguments == "a" * (8 * SLOW_FRAGMENTS)
    assert elapsed > 3  # it was slow: the test paced it, the gateway did not hurry it
    growth = sampler.peak - baseline
    print(f"{len(raw)} bytes in {elapsed:.1f}s; RSS {baseline / MiB:.1f} MiB +{growth / MiB:.1f}")
    assert growth <= 32 * MiB, f"RSS grew by {growth / MiB:.1f} MiB"


async def test_a_reader_catching_up_on_a_long_log_lets_other_connections_run(
    make_client: Any,
) -> None:
    """A backlog is read without waiting, and a socket read as fast as it is written takes
    all of it: without a pause the pump held the event loop for the whole log (0.3 s for
    60 MB, every other stream stalled). Counted as the bytes written between two turns of
    a task that wants the loop all along: at most about ``YIELD_EVERY``."""
    from nexus.server.streaming import YIELD_EVERY, StreamPump

    client = await make_client(
        {"providers": {"mock": {"kind": "mock"}}, "streams": {"detach_timeout_s": 30}}
    )
    body = orjson.loads(tool_call_body(MiB // 2))
    body["background"] = True
    made = await client.post("/v1/chat/completions", json=body)
    assert made.status == 202
    url = (await made.json())["url"]
    runs: list[int] = [0]  # bytes written since the other task last ran
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            runs.append(0)
            turns += 1
            await asyncio.sleep(0)

    write = StreamPump._write

    async def counted(self: StreamPump, data: bytes, *, last: bool = False) -> None:
        runs[-1] += len(data)
        await write(self, data, last=last)

    StreamPump._write = counted  # type: ignore[method-assign]
    ticker = asyncio.create_task(other())
    try:  # a reader in another process, as fast as the socket: curl
        curl = await asyncio.create_subprocess_exec(
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{size_download}",
            f"http://{client.server.host}:{client.server.port}{url}",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(curl.communicate(), 60)
    finally:
        ticker.cancel()
        StreamPump._write = write  # type: ignore[method-assign]
    status, received = out.decode().split()
    assert status == "200" and int(received) > 16 * MiB, out
    assert max(runs) <= 2 * YIELD_EVERY, (max(runs), turns)

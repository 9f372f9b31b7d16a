"""The load generator: C concurrent streams, each timed chunk by chunk. Its own process.

HTTP streams use raw asyncio (a ``Protocol`` per connection, a hand-written chunked
decoder, ``bytes.count`` on whole lines) so that reading costs far less than any
gateway spends writing; the WebSocket format uses aiohttp's client.

A *chunk* is a content delta: a frame whose JSON holds the format's content string
starting with a space (``"content":" …"``; every token of the fake upstream starts with
one, so the empty role chunk and the empty first text block never count). Each format
is counted on its own wire shape and must show its terminator:

=========  ==========================================  ==============  =============================
format     request                                     content         end of stream
=========  ==========================================  ==============  =============================
sse        ``Accept: text/event-stream`` (OpenAI SSE)  ``"content":``  ``data: [DONE]``
nexus      ``?stream_format=nexus`` (native SSE)       ``"content":``  ``event: done``
ndjson     ``Accept: application/x-ndjson``            ``"content":``  ``{"type":"done"}``
anthropic  ``POST /v1/messages`` (Anthropic SSE)       ``"text":``     ``event: message_stop``
responses  ``POST /v1/responses`` (Responses SSE)      ``"delta":``    ``event: response.completed``
ws         ``GET /v1/realtime``, ``start`` envelope    ``"content":``  ``{"type":"done"…}`` frame
=========  ==========================================  ==============  =============================

Per stream it records: time to first byte and to first chunk (from the moment its
connection is opened), the arrival time and size of every read that held chunks
(hence every inter-arrival gap; chunks read together arrive together), total time,
chunks and bytes, and whether it ended well (status 200, the terminator, no error
frame, every expected chunk). With ``stamp`` it also records, per chunk, arrival time
minus the send time the upstream wrote into it (both ``CLOCK_MONOTONIC``).

Jobs are JSON objects (see :class:`Job`). ``python -m bench.loadgen --job '{…}'`` runs
one and prints the result; ``--serve`` reads one job per line on stdin and answers
one result line each, so the harness pays the interpreter's start-up once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from .procfs import new_loop, raise_nofile

__all__ = ["Job", "StreamRecord", "run_job"]

_STAMP_TEXT = re.compile(r'"content": ?" (\d{16})"')


@dataclass(frozen=True)
class Wire:
    """How one HTTP format is asked for and read."""

    accept: str
    end: bytes
    errors: tuple[bytes, ...]
    field: bytes = b"content"
    """The JSON key of a content delta's text."""
    path: str | None = None
    """The endpoint, when not the chat completions one the job's URL names."""
    query: str = ""

    @property
    def content(self) -> tuple[bytes, bytes]:
        return (b'"' + self.field + b'":" ', b'"' + self.field + b'": " ')

    @property
    def stamp(self) -> re.Pattern[bytes]:
        return re.compile(b'"' + self.field + rb'": ?" (\d{16})"')


WIRES = {
    # Nexus's named error event, and the bare error object other servers send.
    "sse": Wire("text/event-stream", b"data: [DONE]", (b"event: error", b'data: {"error"')),
    "nexus": Wire(
        "application/vnd.nexus.events+sse",
        b"event: done",
        (b"event: error",),
        query="stream_format=nexus",
    ),
    "ndjson": Wire("application/x-ndjson", b'{"type":"done"}', (b'{"type":"error"',)),
    "anthropic": Wire(
        "text/event-stream",
        b"event: message_stop",
        (b"event: error",),
        field=b"text",
        path="/v1/messages",
    ),
    "responses": Wire(
        "text/event-stream",
        b"event: response.completed",
        (b"event: error", b"event: response.failed", b"event: response.incomplete"),
        field=b"delta",
        path="/v1/responses",
    ),
}
"""The HTTP formats; ``ws`` is read by :func:`_ws_message`."""


@dataclass
class Job:
    """What to run. ``mode``: ``streams`` (C at once), ``sequential`` (C one after another
    on one keep-alive connection) or ``ws_abort`` (C trials of start, first chunk, abort)."""

    url: str
    urls: list[str] = field(default_factory=list)
    """Every process of a system of several ports: stream i goes to ``urls[i % len(urls)]``
    (HTTP and WebSocket streams; the sequential modes use ``url``). Empty: ``url`` alone."""
    format: str = "sse"
    model: str = "bench"
    streams: int = 1
    expect: int = 0
    """Chunks each stream must deliver to count as ended well (0: any)."""
    mode: str = "streams"
    stamp: bool = False
    stagger_s: float = 0.0
    """Start the streams evenly over this long (0: all at once)."""
    ramp: int = 100
    """At most this many connections between connect and response headers (under the
    smallest listen backlog of the systems: 128, aiohttp's default, the raw proxy's)."""
    timeout_s: float = 120.0
    upstream: str = ""
    """The upstream's base URL, for ``ws_abort`` (it asks when the upstream saw the close)."""
    api_key: str = "sk-bench"
    """Sent as ``Authorization: Bearer``: LiteLLM needs its master key, the others ignore it."""


@dataclass
class StreamRecord:
    t0: float = 0.0
    ttfb: float | None = None
    ttfc: float | None = None
    total: float | None = None
    chunks: int = 0
    bytes: int = 0
    status: int = 0
    end_seen: bool = False
    error: str | None = None
    ok: bool = False
    arrivals: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    opened: float | None = None
    """When the response headers (WebSocket: the handshake) came in, CLOCK_MONOTONIC."""
    abort_ack: float | None = None
    abort_upstream: float | None = None

    def finish(self, now: float, expect: int) -> None:
        if not self.t0:  # never started (the job's deadline came first)
            self.t0 = now
        self.total = now - self.t0
        self.ok = (
            self.status in (101, 200)
            and self.end_seen
            and self.error is None
            and (expect == 0 or self.chunks == expect)
        )


class _Scanner:
    """Counts chunks in a body's bytes, line by line, as they arrive."""

    __slots__ = ("content", "end", "err", "pattern", "rest", "stamp")

    def __init__(self, fmt: str, stamp: bool) -> None:
        wire = WIRES[fmt]
        self.end = wire.end
        self.err = wire.errors
        self.content = wire.content
        self.pattern = wire.stamp
        self.stamp = stamp
        self.rest = b""

    def feed(self, rec: StreamRecord, body: bytes, now: float) -> None:
        data = self.rest + body if self.rest else body
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            self.rest = data
            return
        lines, self.rest = data[:cut], data[cut:]
        n = lines.count(self.content[0]) + lines.count(self.content[1])
        if n:
            if rec.ttfc is None:
                rec.ttfc = now - rec.t0
            rec.chunks += n
            rec.arrivals.append(now)
            rec.counts.append(n)
            if self.stamp:
                rec.delays.extend(now - int(m) / 1e6 for m in self.pattern.findall(lines))
        if self.end in lines:
            rec.end_seen = True
        if rec.error is None and any(err in lines for err in self.err):
            at = max(lines.find(err) for err in self.err)
            rec.error = "error in the stream: " + lines[at : at + 200].decode(errors="replace")


class _Dechunker:
    """Incremental decoder of HTTP/1.1 chunked bodies (RFC 9112 §7.1)."""

    __slots__ = ("buf", "done", "remaining")

    def __init__(self) -> None:
        self.buf = b""
        self.remaining = 0  # body bytes left in the current chunk, then its CRLF
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self.buf + data if self.buf else data
        out: list[bytes] = []
        pos, size = 0, len(buf)
        while pos < size:
            if self.remaining > 2:
                take = min(self.remaining - 2, size - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self.remaining -= take
                continue
            if self.remaining:  # the CRLF after a chunk's data
                take = min(self.remaining, size - pos)
                pos += take
                self.remaining -= take
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            chunk = int(buf[pos:eol].split(b";", 1)[0], 16)
            pos = eol + 2
            if chunk == 0:
                self.done = True  # trailers, if any, are ignored
                pos = size
                break
            self.remaining = chunk + 2
        self.buf = buf[pos:]
        return b"".join(out) if len(out) != 1 else out[0]


class _HTTPConnection(asyncio.Protocol):
    """A client connection that runs requests one at a time and times their responses."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.rec: StreamRecord | None = None
        self.done: asyncio.Future[None] | None = None
        self.headers_in: asyncio.Future[None] | None = None
        self.head = b""
        self.in_body = False
        self.scanner = _Scanner(job.format, job.stamp)
        self.dechunker: _Dechunker | None = None
        self.length: int | None = None

    def request(self, raw: bytes, rec: StreamRecord) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        self.rec, self.head = rec, b""
        self.in_body = False
        self.scanner = _Scanner(self.job.format, self.job.stamp)
        self.dechunker = None
        self.length = None
        self.done = loop.create_future()
        self.headers_in = loop.create_future()
        assert self.transport is not None
        self.transport.write(raw)
        return self.done

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # cast, not isinstance: uvloop's transports do not derive from asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        rec = self.rec
        if rec is None or self.done is None or self.done.done():
            return
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self._headers(self.head[:end], rec, now)
            data, self.head, self.in_body = self.head[end + 4 :], b"", True
            if rec.status != 200:
                rec.error = f"HTTP {rec.status}: "
        if self.dechunker is not None:
            body = self.dechunker.feed(data)
        elif self.length is not None:
            body = data[: self.length]
            self.length -= len(body)
        else:
            body = data
        rec.bytes += len(body)
        if rec.status != 200 and rec.error is not None and len(rec.error) < 200:
            rec.error += body[:200].decode(errors="replace")  # what the system said
        self.scanner.feed(rec, body, now)
        if (self.dechunker is not None and self.dechunker.done) or self.length == 0:
            self._complete(now)

    def _headers(self, head: bytes, rec: StreamRecord, now: float) -> None:
        rec.ttfb = now - rec.t0
        lines = head.decode("latin-1").split("\r\n")
        rec.status = int(lines[0].split(" ", 2)[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "transfer-encoding" and "chunked" in value.lower():
                self.dechunker = _Dechunker()
            elif name == "content-length":
                self.length = int(value)
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_result(None)

    def _complete(self, now: float) -> None:
        assert self.rec is not None and self.done is not None
        self.scanner.feed(self.rec, b"\n", now)  # a last line without its newline
        self.rec.finish(now, self.job.expect)
        self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        now = time.monotonic()
        if not self.closed.done():
            self.closed.set_result(None)
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_result(None)
        if self.rec is not None and self.done is not None and not self.done.done():
            if self.in_body and self.dechunker is None and self.length is None:
                self._complete(now)  # a body delimited by the close
            else:
                self.rec.error = self.rec.error or f"connection closed: {exc or 'EOF'}"
                self.rec.finish(now, self.job.expect)
                self.done.set_result(None)


def _request_bytes(job: Job, target: str | None = None) -> tuple[str, int, bytes]:
    url = urlsplit(target or job.url)
    wire = WIRES[job.format]
    path = wire.path or url.path or "/"
    query = "&".join(filter(None, [url.query, wire.query]))
    if query:
        path += "?" + query
    request: dict[str, Any] = {
        "model": job.model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": True,
    }
    if job.format == "anthropic":
        request["max_tokens"] = 4096
    elif job.format == "responses":
        request["input"] = request.pop("messages")[0]["content"]
    body = json.dumps(request).encode()
    host, port = url.hostname or "127.0.0.1", url.port or 80
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: {wire.accept}\r\nContent-Length: {len(body)}\r\n"
        f"Authorization: Bearer {job.api_key}\r\n\r\n"
    )
    return host, port, head.encode() + body


class _Run:
    """What all streams of a job share: the ramp, the count of open streams."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.deadline = asyncio.get_running_loop().time() + job.timeout_s
        """Every stream of the job ends by then, waiting for the ramp included."""
        self.ramp = asyncio.Semaphore(max(1, job.ramp))
        self.open = 0
        self.peak_open = 0

    def opened(self) -> None:
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)

    def closed(self) -> None:
        self.open -= 1


async def _http_stream(run: _Run, rec: StreamRecord, target: tuple[str, int, bytes]) -> None:
    host, port, raw = target
    loop = asyncio.get_running_loop()
    holding = False
    conn: _HTTPConnection | None = None
    try:
        async with asyncio.timeout_at(run.deadline):
            await run.ramp.acquire()
            holding = True
            rec.t0 = time.monotonic()
            _, conn = await loop.create_connection(lambda: _HTTPConnection(run.job), host, port)
            done = conn.request(raw, rec)
            assert conn.headers_in is not None
            await conn.headers_in
            run.ramp.release()
            holding = False
            rec.opened = time.monotonic()
            run.opened()
            try:
                await done
            finally:
                run.closed()
    except (OSError, TimeoutError) as exc:
        rec.error = rec.error or _failure(exc, rec)
        rec.finish(time.monotonic(), run.job.expect)
    finally:
        if holding:
            run.ramp.release()
        if conn is not None and conn.transport is not None:
            conn.transport.close()


def _failure(exc: BaseException, rec: StreamRecord) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out" if rec.t0 else "timed out before connecting"
    return f"{type(exc).__name__}: {exc}"


async def _http_sequential(run: _Run, recs: list[StreamRecord]) -> None:
    """One request after another on a keep-alive connection (reconnecting if it closes)."""
    host, port, raw = _request_bytes(run.job)
    loop = asyncio.get_running_loop()
    conn: _HTTPConnection | None = None
    for rec in recs:
        rec.t0 = time.monotonic()
        try:
            async with asyncio.timeout_at(run.deadline):
                if conn is None or conn.closed.done():
                    _, conn = await loop.create_connection(
                        lambda: _HTTPConnection(run.job), host, port
                    )
                await conn.request(raw, rec)
        except (OSError, TimeoutError) as exc:
            rec.error = rec.error or _failure(exc, rec)
            rec.finish(time.monotonic(), run.job.expect)
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            conn = None
    if conn is not None and conn.transport is not None:
        conn.transport.close()


def _ws_url(job: Job, target: str | None = None) -> str:
    url = urlsplit(target or job.url)
    return f"ws://{url.hostname}:{url.port}/v1/realtime"


def _ws_start(job: Job) -> str:
    request = {"model": job.model, "messages": [{"role": "user", "content": "Say hello."}]}
    return json.dumps({"type": "start", "request": request})


def _ws_message(rec: StreamRecord, text: str, now: float, stamp: bool) -> bool:
    """Account one server message; True when it ends the turn."""
    if '"content":" ' in text or '"content": " ' in text:
        if rec.ttfc is None:
            rec.ttfc = now - rec.t0
        rec.chunks += 1
        rec.arrivals.append(now)
        rec.counts.append(1)
        if stamp:
            rec.delays.extend(now - int(m) / 1e6 for m in _STAMP_TEXT.findall(text))
        return False
    if text.startswith('{"type":"done"'):
        rec.end_seen = True
        return True
    if text.startswith('{"type":"error"'):
        rec.error = text[:300]
        return True
    return False


async def _ws_turn(ws: Any, rec: StreamRecord, job: Job, start: str) -> None:
    import aiohttp

    await ws.send_str(start)
    async for msg in ws:
        now = time.monotonic()
        if msg.type is aiohttp.WSMsgType.TEXT:
            if rec.ttfb is None:
                rec.ttfb = now - rec.t0
            rec.bytes += len(msg.data)
            if _ws_message(rec, msg.data, now, job.stamp):
                break
        else:
            rec.error = f"websocket {msg.type.name}"
            break
    else:
        rec.error = rec.error or "websocket closed mid-turn"
    rec.finish(time.monotonic(), job.expect)


async def _ws_stream(run: _Run, session: Any, rec: StreamRecord, target: str) -> None:
    job = run.job
    holding = False
    try:
        async with asyncio.timeout_at(run.deadline):
            await run.ramp.acquire()
            holding = True
            rec.t0 = time.monotonic()
            async with session.ws_connect(_ws_url(job, target), autoping=True) as ws:
                rec.status = 101
                run.ramp.release()
                holding = False
                rec.opened = time.monotonic()
                run.opened()
                try:
                    await _ws_turn(ws, rec, job, _ws_start(job))
                finally:
                    run.closed()
    except Exception as exc:  # aiohttp's errors, timeouts: the stream failed, the run goes on
        rec.error = rec.error or _failure(exc, rec)
        rec.finish(time.monotonic(), job.expect)
    finally:
        if holding:
            run.ramp.release()


async def _ws_sequential(run: _Run, session: Any, recs: list[StreamRecord]) -> None:
    """Turns one after another on one WebSocket."""
    job = run.job
    start = _ws_start(job)
    try:
        async with asyncio.timeout_at(run.deadline):
            async with session.ws_connect(_ws_url(job)) as ws:
                for rec in recs:
                    rec.t0 = time.monotonic()
                    rec.status = 101
                    await _ws_turn(ws, rec, job, start)
    except Exception as exc:  # the turns not run are failures of this job, not of the run
        for rec in recs:
            if rec.total is None:
                rec.error = rec.error or _failure(exc, rec)
                rec.finish(time.monotonic(), job.expect)


async def _ws_abort(run: _Run, session: Any, recs: list[StreamRecord]) -> None:
    """Per trial: start a turn, wait for its first chunk, send ``abort``; then ask the
    upstream when it saw its connection close (``GET /_bench/closed``, CLOCK_MONOTONIC)."""
    import aiohttp

    job = run.job
    start = _ws_start(job)
    for rec in recs:
        rec.t0 = time.monotonic()
        try:
            async with asyncio.timeout(job.timeout_s):
                async with session.ws_connect(_ws_url(job)) as ws:
                    rec.status = 101
                    await ws.send_str(start)
                    async for msg in ws:
                        if msg.type is not aiohttp.WSMsgType.TEXT:
                            break
                        if _ws_message(rec, msg.data, time.monotonic(), False) or rec.chunks:
                            break
                    t_abort = time.monotonic()
                    await ws.send_str('{"type":"abort"}')
                    async for msg in ws:
                        if msg.type is not aiohttp.WSMsgType.TEXT:
                            break
                        if '"aborted":true' in msg.data:
                            rec.abort_ack = time.monotonic() - t_abort
                            rec.end_seen = True
                            break
                    rec.abort_upstream = await _upstream_close(session, job, rec.t0, t_abort)
        except Exception as exc:  # a failed trial is recorded, the next one runs
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
        if rec.abort_upstream is None and rec.error is None:
            rec.error = "the upstream never saw its connection close"
        rec.finish(time.monotonic(), 0)


async def _upstream_close(session: Any, job: Job, after: float, t_abort: float) -> float | None:
    url = f"{job.upstream.rstrip('/')}/_bench/closed?after={after!r}"
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        async with session.get(url) as resp:
            closed = (await resp.json())["closed"]
        if closed:
            return float(min(closed)) - t_abort
        await asyncio.sleep(0.002)
    return None


async def run_job(job: Job) -> dict[str, Any]:
    """Run ``job``; the records of its streams and the figures of the whole run."""
    run = _Run(job)
    recs = [StreamRecord() for _ in range(job.streams)]
    started = time.monotonic()
    if job.format == "ws":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            if job.mode == "ws_abort":
                await _ws_abort(run, session, recs)
            elif job.mode == "sequential":
                await _ws_sequential(run, session, recs)
            else:
                urls = job.urls or [job.url]
                streams = [
                    _ws_stream(run, session, rec, urls[i % len(urls)]) for i, rec in enumerate(recs)
                ]
                await _staggered(job, streams)
    elif job.mode == "sequential":
        await _http_sequential(run, recs)
    else:
        targets = [_request_bytes(job, url) for url in job.urls or [job.url]]
        await _staggered(
            job, [_http_stream(run, rec, targets[i % len(targets)]) for i, rec in enumerate(recs)]
        )
    ends = [rec.t0 + rec.total for rec in recs if rec.total is not None]
    first = min((rec.t0 for rec in recs if rec.t0), default=started)
    opened = [rec.opened for rec in recs if rec.opened is not None]
    return {
        "job": asdict(job),
        "wall_s": (max(ends) - first) if ends else None,
        "ramp_s": (max(opened) - first) if opened else None,
        "peak_open": run.peak_open,
        "streams": [_summary(rec) for rec in recs],
        "gaps": _gap_summary(_gaps(recs)),
        "delays": [d for rec in recs for d in rec.delays],
    }


async def _staggered(job: Job, coros: list[Any]) -> None:
    if job.stagger_s <= 0 or len(coros) < 2:
        await asyncio.gather(*coros)
        return
    step = job.stagger_s / (len(coros) - 1)

    async def later(i: int, coro: Any) -> None:
        await asyncio.sleep(i * step)
        await coro

    await asyncio.gather(*(later(i, c) for i, c in enumerate(coros)))


def _summary(rec: StreamRecord) -> dict[str, Any]:
    out = {
        "ttfb": rec.ttfb,
        "ttfc": rec.ttfc,
        "total": rec.total,
        "chunks": rec.chunks,
        "bytes": rec.bytes,
        "reads": len(rec.arrivals),
        "ok": rec.ok,
        "error": rec.error,
    }
    if rec.abort_ack is not None or rec.abort_upstream is not None:
        out["abort_ack"] = rec.abort_ack
        out["abort_upstream"] = rec.abort_upstream
    return out


def _gaps(recs: list[StreamRecord]) -> list[float]:
    """Every inter-arrival gap between consecutive chunks of a stream (0 within a read)."""
    gaps: list[float] = []
    for rec in recs:
        previous = None
        for now, n in zip(rec.arrivals, rec.counts, strict=True):
            if previous is not None:
                gaps.append(now - previous)
            gaps.extend([0.0] * (n - 1))
            previous = now
    return gaps


def _gap_summary(gaps: list[float]) -> dict[str, float | int | None]:
    """p50, p99 and max of the gaps, in seconds (the gaps themselves are too many to ship)."""
    if not gaps:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    gaps.sort()
    last = len(gaps) - 1
    return {
        "count": len(gaps),
        "p50": gaps[round(0.50 * last)],
        "p99": gaps[round(0.99 * last)],
        "max": gaps[last],
    }


def _serve() -> None:
    """One job per stdin line, one result per stdout line, until stdin closes."""
    loop = new_loop()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = loop.run_until_complete(run_job(Job(**json.loads(line))))
        except Exception as exc:  # report it to the harness instead of dying
            result = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--job", help="one job as JSON (see Job); prints its result")
    group.add_argument("--serve", action="store_true", help="jobs on stdin, results on stdout")
    args = parser.parse_args()
    raise_nofile()
    if args.serve:
        _serve()
    else:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            print(json.dumps(runner.run(run_job(Job(**json.loads(args.job))))))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

"""A fake LLM upstream for the benchmarks, in its own process: OpenAI and Anthropic.

``POST …/chat/completions`` with ``"stream": true`` answers with the SSE stream of an
OpenAI server; ``POST …/v1/messages`` with that of Anthropic's Messages API. The frames
are the providers' own (``bench/frames.py``): by default today's realistic wire (OpenAI's
random ``obfuscation`` per chunk unless the request sends
``"stream_options": {"include_obfuscation": false}``), or, as an explicit option for
comparison, the old synthetic OpenAI frames. The first content frame goes out at once,
the next ones every ``delay_ms``.

It is raw asyncio (a ``Protocol``, hand-parsed HTTP/1.1 with keep-alive) rather than
aiohttp so that it is never the bottleneck: frames come from pools built once per
setting, and without a delay or stamp the whole body is pre-encoded, chunked framing
included, and written ``batch`` frames per ``write()`` for as long as the socket takes it.

N and the delay are *not* taken from the request: gateways rewrite the model name
and may drop unknown headers or fields. The harness sets them per scenario on a
control endpoint, which it calls directly, never through a gateway::

    POST /_bench/config   {"chunks": N, "delay_ms": D, "stamp": false, "batch": 1,
                           "frames": "realistic", "obfuscation": "default"}
    GET  /_bench/closed?after=T   {"closed": [t, ...]}  streams whose client left
                                  before their end, at t >= T
    GET  /_bench/stats    {"started": …, "completed": …, "closed_early": …}

``obfuscation``: ``default`` (OpenAI's: on unless the request turns it off) or ``off``
(never, whatever the request says: what a gateway that turns it off would get).

With ``stamp``, each content delta is a space and the send time as 16 digits of
microseconds of ``time.monotonic()``. On Linux that clock is ``CLOCK_MONOTONIC``,
one clock for the whole machine, so the load generator compares its own arrival
times with it: arrival minus send is each chunk's delay. The close times of
``/_bench/closed`` are on the same clock.

Run: ``python -m bench.upstream [--port P]``; prints ``READY <port>`` when listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from typing import cast
from urllib.parse import parse_qs, urlsplit

from .frames import FRAMES, VARIANTS, Frames, Shape, frames
from .procfs import new_loop, raise_nofile

__all__ = ["Settings", "main"]

_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_LAST_CHUNK = b"0\r\n\r\n"
OBFUSCATION = ("default", "off")


def _chunked(data: bytes) -> bytes:
    """One HTTP/1.1 chunk (RFC 9112 §7.1)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def stamp() -> bytes:
    """A content text that is the send time (µs of CLOCK_MONOTONIC, 16 digits)."""
    return b" %016d" % (time.monotonic_ns() // 1000)


@dataclass(frozen=True)
class Settings:
    """What every stream sends until the harness changes it."""

    chunks: int = 20
    delay_ms: float = 0.0
    stamp: bool = False
    batch: int = 1
    frames: str = "realistic"
    obfuscation: str = "default"

    @classmethod
    def parse(cls, conf: dict[str, object]) -> Settings:
        """From the control endpoint's JSON; ValueError for what it cannot take."""
        settings = cls(
            int(cast(int, conf.get("chunks", 20))),
            float(cast(float, conf.get("delay_ms", 0.0))),
            bool(conf.get("stamp", False)),
            max(1, int(cast(int, conf.get("batch", 1)))),
            str(conf.get("frames", "realistic")),
            str(conf.get("obfuscation", "default")),
        )
        if settings.frames not in FRAMES:
            raise ValueError(f"frames: {settings.frames!r} is not one of {FRAMES}")
        if settings.obfuscation not in OBFUSCATION:
            raise ValueError(f"obfuscation: {settings.obfuscation!r} is not one of {OBFUSCATION}")
        return settings

    @property
    def pre_encoded(self) -> bool:
        """Whether a stream's whole body is built once and written as fast as taken."""
        return self.delay_ms <= 0 and not self.stamp


class Upstream:
    """Shared state of the server: the settings, the frames built for them, and what
    happened to the streams."""

    def __init__(self) -> None:
        self.settings = Settings()
        self.closed: list[float] = []
        self.started = 0
        self.completed = 0
        self._frames: dict[tuple[Shape, int], Frames] = {}
        self._bodies: dict[tuple[Shape, int], tuple[bytes, ...]] = {}

    def configure(self, settings: Settings) -> None:
        self.settings = settings
        self._bodies.clear()

    def frames(self, shape: Shape) -> Frames:
        """The frames of the next stream: the ``VARIANTS`` streams of a shape in turn."""
        key = (shape, self.started % VARIANTS)
        found = self._frames.get(key)
        if found is None:
            found = self._frames[key] = frames(*key)
        return found

    def body(self, f: Frames) -> tuple[bytes, ...]:
        """The pre-encoded body of a stream of ``f``: HTTP chunks of ``batch`` frames each,
        through the last chunk."""
        key = (f.shape, f.seed)
        found = self._bodies.get(key)
        if found is None:
            s = self.settings
            every = [*f.opening, *(f.content(i) for i in range(s.chunks)), *f.closing(s.chunks)]
            step = s.batch
            found = self._bodies[key] = (
                *(_chunked(b"".join(every[i : i + step])) for i in range(0, len(every), step)),
                _LAST_CHUNK,
            )
        return found


class Connection(asyncio.Protocol):
    """One client connection: requests one after another (keep-alive), one stream at a time."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.streaming = False
        self.gone = False
        self.writable = asyncio.Event()
        self.writable.set()

    # -- asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # cast, not isinstance: uvloop's transports do not derive from asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next_request()

    def eof_received(self) -> bool:
        self._left()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._left()
        self.writable.set()
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # -- requests ----------------------------------------------------------------------

    def _left(self) -> None:
        """The client went away: note it if it left in the middle of a stream."""
        if not self.gone:
            self.gone = True
            if self.streaming:
                self.upstream.closed.append(time.monotonic())

    def _next_request(self) -> None:
        parsed = _parse_request(self.buffer)
        if parsed is None:
            return
        method, target, headers, body, used = parsed
        self.buffer = self.buffer[used:]
        keep_alive = headers.get("connection", "").lower() != "close"
        path = urlsplit(target).path
        provider = (
            "openai"
            if path.endswith("/chat/completions")
            else "anthropic"
            if path.endswith("/v1/messages")
            else None
        )
        if method == "POST" and provider is not None:
            chat = self._chat(provider, body, keep_alive)
            self.task = asyncio.get_running_loop().create_task(chat)
            self.task.add_done_callback(self._request_done)
        else:
            status, payload = self._control(method, target, body)
            self._respond(status, payload, keep_alive)
            if keep_alive and not self.gone:
                self._next_request()

    def _request_done(self, task: asyncio.Task[None]) -> None:
        self.task = None
        if not task.cancelled() and task.exception() is None and not self.gone:
            self._next_request()

    def _respond(self, status: int, payload: object, keep_alive: bool) -> None:
        assert self.transport is not None
        body = json.dumps(payload).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "OK")
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
        )
        if not keep_alive:
            head += "Connection: close\r\n"
        self.transport.write(head.encode() + b"\r\n" + body)
        if not keep_alive:
            self.transport.close()

    def _control(self, method: str, target: str, body: bytes) -> tuple[int, object]:
        url = urlsplit(target)
        up = self.upstream
        if url.path == "/_bench/config" and method == "POST":
            try:
                up.configure(Settings.parse(json.loads(body or b"{}")))
            except (ValueError, TypeError, AttributeError) as exc:
                return 400, {"error": str(exc)}
            return 200, asdict(up.settings)
        if url.path == "/_bench/closed":
            after = float(parse_qs(url.query).get("after", ["0"])[0])
            return 200, {"closed": [t for t in up.closed if t >= after]}
        if url.path == "/_bench/stats":
            return 200, {
                "started": up.started,
                "completed": up.completed,
                "closed_early": len(up.closed),
            }
        if url.path.endswith("/models"):
            return 200, {"object": "list", "data": [{"id": "bench", "object": "model"}]}
        return 404, {"error": {"message": f"no route {method} {url.path}", "type": "not_found"}}

    async def _chat(self, provider: str, body: bytes, keep_alive: bool) -> None:
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = {}
        if not isinstance(request, dict) or not request.get("stream"):
            self._respond(200, _completion(provider, self.upstream.settings.chunks), keep_alive)
            return
        options = request.get("stream_options")
        options = options if isinstance(options, dict) else {}
        settings = self.upstream.settings
        shape = Shape(
            provider,
            settings.frames,
            include_usage=bool(options.get("include_usage")),
            obfuscation=settings.obfuscation == "default"
            and options.get("include_obfuscation") is not False,
        )
        f = self.upstream.frames(shape)
        self.streaming = True
        self.upstream.started += 1
        try:
            await self._stream(settings, f)
        finally:
            self.streaming = False
        self.upstream.completed += 1
        if not keep_alive and self.transport is not None:
            self.transport.close()

    async def _stream(self, s: Settings, f: Frames) -> None:
        transport = self.transport
        assert transport is not None
        write, writable = transport.write, self.writable
        write(_STREAM_HEAD)
        if s.pre_encoded:
            for piece in self.upstream.body(f):
                write(piece)
                if not writable.is_set():
                    await writable.wait()
            return
        loop = asyncio.get_running_loop()
        write(_chunked(b"".join(f.opening)))
        start = loop.time()
        delay = s.delay_ms / 1000
        for i in range(s.chunks):
            if i and delay > 0:
                # An absolute schedule: sleep jitter does not add up over the stream.
                await asyncio.sleep(max(0.0, start + i * delay - loop.time()))
            write(_chunked(f.content(i, stamp() if s.stamp else None)))
            if not writable.is_set():
                await writable.wait()
        write(_chunked(b"".join(f.closing(s.chunks))) + _LAST_CHUNK)


def _completion(provider: str, chunks: int) -> dict[str, object]:
    """The non-streaming answer (health checks of some gateways send one)."""
    if provider == "anthropic":
        return {
            "id": "msg_01bench",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5-20250929",
            "content": [{"type": "text", "text": "hello"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 8, "output_tokens": chunks},
        }
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": chunks, "total_tokens": chunks + 8},
    }


def _parse_request(buffer: bytes) -> tuple[str, str, dict[str, str], bytes, int] | None:
    """(method, target, headers, body, bytes used) of the first complete request, else None.

    Bodies with ``Content-Length`` or ``Transfer-Encoding: chunked`` (a proxy that streams
    the request through sends the latter).
    """
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buffer[:end].decode("latin-1").split("\r\n")
    method, target = lines[0].split(" ", 2)[:2]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    start = end + 4
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body_parts: list[bytes] = []
        pos = start
        while True:
            eol = buffer.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(buffer[pos:eol].split(b";")[0], 16)
            pos = eol + 2
            if size == 0:
                trailer_end = buffer.find(b"\r\n", pos)  # no trailers expected
                if trailer_end < 0:
                    return None
                return method, target, headers, b"".join(body_parts), trailer_end + 2
            if len(buffer) < pos + size + 2:
                return None
            body_parts.append(buffer[pos : pos + size])
            pos += size + 2
    length = int(headers.get("content-length", "0") or 0)
    if len(buffer) < start + length:
        return None
    return method, target, headers, buffer[start : start + length], start + length


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    upstream = Upstream()
    server = await loop.create_server(lambda: Connection(upstream), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    raise_nofile()
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()

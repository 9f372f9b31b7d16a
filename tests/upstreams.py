"""A scripted fake upstream: a real aiohttp server on 127.0.0.1 that the HTTP providers call.

Each request is recorded (:class:`Seen`: path, headers, JSON body, when its
handler ended and whether it was cancelled), then answered with the next
scripted :class:`Reply`: a status and a whole body, or raw byte chunks written
one by one (each flushed to the socket), with optional delays, ending cleanly,
by aborting the connection, or by stalling until the client goes away.

The server runs with ``handler_cancellation=True``, so a client that drops the
connection cancels the handler: ``Seen.ended_at`` is then the moment the fake
noticed, measured with ``loop.time()``. Chunks are bytes, so the same fake
serves any SSE dialect byte for byte (OpenAI ``data:`` frames, Anthropic's
named events)::

    async with FakeUpstream() as fake:
        fake.add(Reply.stream([openai_chunk(content="Hi"), openai_chunk(finish_reason="stop")]))
        ... point a provider's base_url at fake.url + "/v1" ...
        assert fake.requests[0].body["stream"] is True

    # Anthropic: named events, no [DONE]
    Reply.stream([sse({"type": "ping"}, event="ping"), ...], path="/v1/messages")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web
from multidict import CIMultiDict

__all__ = [
    "AUDIO_EXPIRES",
    "AUDIO_ID",
    "DONE",
    "FakeUpstream",
    "Reply",
    "Seen",
    "closed_port",
    "openai_audio_stream",
    "openai_chunk",
    "openai_error_body",
    "openai_usage_chunk",
    "sse",
]

DONE = b"data: [DONE]\n\n"

End = Literal["eof", "abort", "stall"]


@dataclass
class Reply:
    """One scripted answer.

    With ``chunks is None`` the answer is ``status`` + ``body`` in one piece;
    otherwise the headers go out at once and each chunk is written after its
    delay (``delay`` before every chunk, or one delay per chunk). ``end`` says
    what follows the last chunk: ``eof`` ends the body cleanly, ``abort`` drops
    the TCP connection, ``stall`` waits forever (until the client leaves).
    ``headers_delay`` holds back the status line itself.
    """

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    chunks: Sequence[bytes] | None = None
    delay: float | Sequence[float] = 0.0
    end: End = "eof"
    headers_delay: float = 0.0
    eof_delay: float = 0.0
    """A pause between the last chunk and the end of the body (``end="eof"``)."""
    path: str | None = None
    """Only requests to this path take this reply (None: any path)."""
    gate: asyncio.Event | None = None
    """The chunks after the first wait for it (a test sets it): streams held open at once."""

    @classmethod
    def json(cls, status: int, obj: Any, headers: dict[str, str] | None = None, **kw: Any) -> Reply:
        return cls(
            status=status,
            body=orjson.dumps(obj),
            headers={"Content-Type": "application/json", **(headers or {})},
            **kw,
        )

    @classmethod
    def stream(
        cls,
        chunks: Sequence[bytes],
        *,
        delay: float | Sequence[float] = 0.0,
        end: End = "eof",
        headers: dict[str, str] | None = None,
        **kw: Any,
    ) -> Reply:
        return cls(
            chunks=list(chunks),
            delay=delay,
            end=end,
            headers={"Content-Type": "text/event-stream", **(headers or {})},
            **kw,
        )

    def delays(self) -> list[float]:
        count = len(self.chunks or ())
        if isinstance(self.delay, int | float):
            return [float(self.delay)] * count
        if len(self.delay) != count:
            raise ValueError(f"{len(self.delay)} delays for {count} chunks")
        return [float(d) for d in self.delay]


@dataclass
class Seen:
    """One request the fake received, and what became of its handler."""

    method: str
    path: str
    headers: CIMultiDict[str]
    raw: bytes
    started_at: float
    chunks_sent: int = 0
    peer: Any = None
    """The client's (host, port): the same port on two requests means one kept-alive connection."""
    query: str = ""
    """The request target's query string, as sent."""
    ended_at: float | None = None
    cancelled: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def body(self) -> Any:
        return orjson.loads(self.raw)

    async def wait_ended(self, timeout: float = 5.0) -> float:
        """When the handler ended (``loop.time()``); waits up to ``timeout`` seconds."""
        await asyncio.wait_for(self.ended.wait(), timeout)
        assert self.ended_at is not None
        return self.ended_at


class FakeUpstream:
    """The server. ``add()`` queues replies; ``default`` answers when the queue is empty."""

    def __init__(self, *replies: Reply, default: Reply | None = None) -> None:
        self.replies: deque[Reply] = deque(replies)
        self.default = default
        self.requests: list[Seen] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Cancel handlers when their client leaves; don't wait long for stalled ones at close.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _take(self, path: str) -> Reply:
        for reply in self.replies:
            if reply.path is None or reply.path == path:
                self.replies.remove(reply)
                return reply
        if self.default is not None:
            return self.default
        return Reply.json(500, {"error": {"message": f"fake upstream: no reply for {path}"}})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        seen = Seen(
            method=request.method,
            path=request.path,
            headers=CIMultiDict(request.headers),
            raw=await request.read(),
            started_at=loop.time(),
            peer=request.transport.get_extra_info("peername") if request.transport else None,
            query=request.query_string,
        )
        self.requests.append(seen)
        reply = self._take(request.path)
        try:
            if reply.headers_delay:
                await asyncio.sleep(reply.headers_delay)
            if reply.chunks is None:
                return web.Response(status=reply.status, body=reply.body, headers=reply.headers)
            response = web.StreamResponse(status=reply.status, headers=reply.headers)
            await response.prepare(request)
            for n, (delay, chunk) in enumerate(zip(reply.delays(), reply.chunks, strict=True)):
                if n == 1 and reply.gate is not None:
                    await reply.gate.wait()
                if delay:
                    await asyncio.sleep(delay)
                await response.write(chunk)
                seen.chunks_sent += 1
            if reply.end == "stall":
                await asyncio.Event().wait()
            if reply.end == "abort":
                assert request.transport is not None
                request.transport.abort()
                return response
            if reply.eof_delay:
                await asyncio.sleep(reply.eof_delay)
            await response.write_eof()
            return response
        except asyncio.CancelledError:
            seen.cancelled = True
            raise
        finally:
            seen.ended_at = loop.time()
            seen.ended.set()


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# --- byte-exact frames -------------------------------------------------------


def sse(data: bytes | str | Any, event: str | None = None) -> bytes:
    """One SSE frame: ``event: NAME\\n`` (optional), ``data: ...\\n\\n``.

    ``data`` that is not bytes or str is serialised compactly with orjson.
    """
    if isinstance(data, str):
        payload = data.encode()
    elif isinstance(data, bytes):
        payload = data
    else:
        payload = orjson.dumps(data)
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    return head + b"data: " + payload + b"\n\n"


def openai_chunk(
    *,
    finish_reason: str | None = None,
    chunk_id: str = "chatcmpl-upstream",
    model: str = "upstream-model",
    created: int = 1700000000,
    **delta: Any,
) -> bytes:
    """A ``chat.completion.chunk`` frame for choice 0 (docs/protocols.md §2).

    Keyword arguments other than the named ones form the delta, in order:
    ``openai_chunk(content="Hi")``, ``openai_chunk(tool_calls=[...])``,
    ``openai_chunk(finish_reason="stop")``.
    """
    chunk = {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        "usage": None,
    }
    return sse(chunk)


def openai_usage_chunk(
    usage: dict[str, Any],
    *,
    chunk_id: str = "chatcmpl-upstream",
    model: str = "upstream-model",
    created: int = 1700000000,
) -> bytes:
    """The trailing ``choices: []`` chunk that carries ``usage`` (``include_usage``)."""
    chunk = {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }
    return sse(chunk)


def openai_error_body(
    message: str, type_: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` (docs/protocols.md §5)."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def anthropic_event(name: str, **fields: Any) -> bytes:
    """An Anthropic Messages SSE frame: ``event: NAME`` and ``type`` first in its data."""
    return sse({"type": name, **fields}, event=name)


def anthropic_stream(blocks: list[dict[str, Any]], stop_reason: str = "end_turn") -> list[bytes]:
    """The stream Anthropic sends for a message of these whole content blocks
    (docs/protocols.md §3): each block opened in its initial form and filled by its deltas
    (text, after its ``citations``; thinking then its signature, a tool's input as JSON:
    ``""`` for an empty one);
    a ``redacted_thinking`` block comes whole."""
    message = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-x",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1},
    }
    frames = [anthropic_event("message_start", message=message)]
    for index, block in enumerate(blocks):
        kind = block["type"]
        deltas: list[dict[str, Any]] = []
        start = block
        if kind == "text":
            start = {"type": "text", "text": ""}
            deltas = [
                {"type": "citations_delta", "citation": c} for c in block.get("citations", ())
            ]
            deltas.append({"type": "text_delta", "text": block["text"]})
        elif kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "tool_use":
            start = {**block, "input": {}}
            partial = orjson.dumps(block["input"]).decode() if block["input"] else ""
            deltas = [{"type": "input_json_delta", "partial_json": partial}]
        frames.append(anthropic_event("content_block_start", index=index, content_block=start))
        for delta in deltas:
            frames.append(anthropic_event("content_block_delta", index=index, delta=delta))
        frames.append(anthropic_event("content_block_stop", index=index))
    delta = {"stop_reason": stop_reason, "stop_sequence": None}
    frames.append(anthropic_event("message_delta", delta=delta, usage={"output_tokens": 5}))
    frames.append(anthropic_event("message_stop"))
    return frames


AUDIO_ID = "audio_672960c3a3e48190aed70377a7d6c941"
AUDIO_EXPIRES = 1730768595


def openai_audio_stream(
    transcript: Sequence[str],
    pcm: Sequence[bytes],
    audio_tokens: int = 9,
    usage: dict[str, Any] | None = None,
) -> list[bytes]:
    """A streamed answer with ``modalities: ["text", "audio"]``, as OpenAI sends it: the
    role, the transcript pieces (the first with the audio's ``id``), the audio pieces (the
    first with the ``id`` again and a repeated role), each piece of audio base64 on its
    own (padded), the expiry alone, the finish, the usage with its audio tokens (or
    ``usage``), [DONE]."""
    chunks = [openai_chunk(role="assistant", refusal=None)]
    for n, piece in enumerate(transcript):
        first = {"id": AUDIO_ID} if n == 0 else {}
        extra = {"content": None} if n == 0 else {}
        chunks.append(openai_chunk(**extra, audio={**first, "transcript": piece}))
    for n, raw in enumerate(pcm):
        data = base64.b64encode(raw).decode()
        if n == 0:
            audio = {"id": AUDIO_ID, "data": data}
            chunks.append(openai_chunk(role="assistant", content=None, refusal=None, audio=audio))
        else:
            chunks.append(openai_chunk(audio={"data": data}))
    chunks.append(openai_chunk(audio={"expires_at": AUDIO_EXPIRES}))
    chunks.append(openai_chunk(finish_reason="stop"))
    text_tokens = len(transcript)
    usage = usage or {
        "prompt_tokens": 17,
        "completion_tokens": audio_tokens + text_tokens,
        "total_tokens": 17 + audio_tokens + text_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": audio_tokens,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
            "text_tokens": text_tokens,
        },
    }
    return [*chunks, openai_usage_chunk(usage), DONE]

"""Lifecycle hooks and middleware (nexus.hooks): over HTTP on every endpoint, and from Python."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from nexus import (
    CallContext,
    ChatRequest,
    Completion,
    Delta,
    Done,
    Engine,
    Error,
    GatewayError,
    Hooks,
    Middleware,
    MockProvider,
    Provider,
    RegistryFrozen,
    Stream,
    StreamError,
    StreamEvent,
    StreamRejected,
    Usage,
    accumulate,
    map_stream,
)
from nexus.config import Config, PluginConfig, parse_config
from nexus.encoders.registry import default_registry
from nexus.errors import ConfigError, InvalidRequest
from nexus.hooks import Next
from nexus.providers.mock import words
from nexus.server.app import create_app
from nexus.server.state import ENGINE, HUB
from nexus.types import StreamMeta
from support import GatedProvider, MakeClient, chat

TEXT = "Hello there world"
KINDS = ["delta", "delta", "delta", "delta", "usage"]
"""What the mock sends for TEXT: three words, the finish, the usage."""

LOADED: dict[str, RecordingPlugin] = {}
"""Plugins built from ``[[plugins]]`` by name, for the tests to find them."""


class RecordingPlugin:
    """Records every hook call; ``reject`` makes on_stream_started refuse (code, status)."""

    def __init__(self, name: str = "", reject: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.reject = reject
        if name:
            LOADED[name] = self

    async def on_stream_started(
        self, ctx: CallContext, request_id: str, model: str, provider: str
    ) -> None:
        self.calls.append(("started", (ctx, request_id, model, provider)))
        if self.reject is not None:
            code, status = self.reject
            raise StreamRejected("Refused by policy.", code=code, status=status)

    async def on_chunk_received(
        self, ctx: CallContext, request_id: str, kind: str, byte_size: int
    ) -> None:
        self.calls.append(("chunk", (ctx, request_id, kind, byte_size)))

    async def on_stream_completed(
        self,
        ctx: CallContext,
        request_id: str,
        model: str,
        provider: str,
        elapsed: float,
        final: Completion,
    ) -> None:
        self.calls.append(("completed", (ctx, request_id, model, provider, elapsed, final)))

    async def on_stream_failed(
        self, ctx: CallContext, request_id: str, model: str, error: Error
    ) -> None:
        self.calls.append(("failed", (ctx, request_id, model, error)))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def of(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args in self.calls if n == name]


class RaisingPlugin:
    """Every hook raises (not a rejection)."""

    async def on_stream_started(self, *args: Any) -> None:
        raise RuntimeError("started broke")

    async def on_chunk_received(self, *args: Any) -> None:
        raise RuntimeError("chunk broke")

    async def on_stream_completed(self, *args: Any) -> None:
        raise RuntimeError("completed broke")

    async def on_stream_failed(self, *args: Any) -> None:
        raise RuntimeError("failed broke")


class StartedOnly:
    async def on_stream_started(self, *args: Any) -> None:
        pass


def make_plugin(**options: Any) -> RecordingPlugin:
    """A factory, for ``path = "test_hooks:make_plugin"``."""
    return RecordingPlugin(**options)


READY = RecordingPlugin()
"""A ready plugin object, for ``path = "test_hooks:READY"``."""


# --- helpers -----------------------------------------------------------------------------

HookedClient = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def hooked(aiohttp_client: Any) -> HookedClient:
    """``await hooked(hooks=None, middleware=(), config=None, providers=())`` -> a test client
    over an engine built here with those hooks and middleware."""

    async def factory(
        hooks: Hooks | None = None,
        middleware: Sequence[Middleware] = (),
        config: dict[str, Any] | None = None,
        providers: Sequence[Provider] = (),
    ) -> TestClient[Any, Any]:
        # The built-in metrics plugin would add its hooks beside the ones under test.
        cfg: Config = parse_config({"metrics": {"enabled": False}, **(config or {})})
        engine = Engine(
            [MockProvider(name, models=p.models) for name, p in cfg.providers.items()]
            + list(providers),
            {alias: a.targets for alias, a in cfg.models.items()},
            retry_ms=cfg.server.retry_ms,
            hooks=hooks,
            middleware=middleware,
        )
        app = create_app(cfg, engine=engine, registry=default_registry.copy())
        client: TestClient[Any, Any] = await aiohttp_client(app)
        return client

    return factory


def hooks_of(*plugins: object, chunk_every: int = 1) -> Hooks:
    hooks = Hooks()
    for plugin in plugins:
        hooks.add(plugin, chunk_every)
    return hooks


def body_for(path: str, text: str = TEXT, *, stream: bool, **extra: Any) -> dict[str, Any]:
    """A request for the mock in the shape of ``path``'s API."""
    if path == "/v1/messages":
        body: dict[str, Any] = {
            "model": "mock/echo",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": text}],
        }
    elif path == "/v1/responses":
        body = {"model": "mock/echo", "input": text}
    else:
        body = chat(text)
    return {**body, "stream": stream, **extra}


def text_of(path: str, data: dict[str, Any]) -> str:
    """The text of a non-streaming answer of ``path``'s API."""
    if path == "/v1/messages":
        return "".join(b["text"] for b in data["content"] if b["type"] == "text")
    if path == "/v1/responses":
        return "".join(
            part["text"]
            for item in data["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
    return str(data["choices"][0]["message"]["content"])


ENDPOINTS = ["/v1/chat/completions", "/v1/messages", "/v1/responses"]


def event_bytes(event: StreamEvent) -> int:
    return len(orjson.dumps(event.to_dict()))


MOCK_EVENTS: list[StreamEvent] = [
    Delta(content="Hello"),
    Delta(content=" there"),
    Delta(content=" world"),
    Delta(finish_reason="stop"),
    Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6),
]


def assert_full_lifecycle(plugin: RecordingPlugin, stream_id: str | None = None) -> str:
    """started, a chunk per event, completed: with the right arguments. Returns the id."""
    assert plugin.names() == ["started", *["chunk"] * len(KINDS), "completed"]
    ((ctx, request_id, model, provider),) = plugin.of("started")
    assert isinstance(ctx, CallContext)
    assert (model, provider) == ("mock/echo", "mock")
    if stream_id is not None:
        assert request_id == stream_id
    chunks = plugin.of("chunk")
    assert [c[2] for c in chunks] == KINDS
    assert [c[3] for c in chunks] == [event_bytes(e) for e in MOCK_EVENTS]
    ((_, c_id, c_model, c_provider, elapsed, final),) = plugin.of("completed")
    # One context object along the whole call (plugins share ctx.metadata through it).
    assert all(args[0] is ctx for _, args in plugin.calls)
    assert {c[1] for c in chunks} == {c_id} == {request_id}
    assert (c_model, c_provider) == ("mock/echo", "mock")
    assert isinstance(elapsed, float) and 0 <= elapsed < 10
    assert isinstance(final, Completion)
    assert final.id == request_id
    assert final.content == TEXT
    assert final.finish_reason == "stop"
    assert final.usage == Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6)
    return str(request_id)


# --- all four hooks over HTTP --------------------------------------------------------------


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_hooks_fire_on_a_streaming_request(hooked: HookedClient, path: str) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin))
    resp = await client.post(path, json=body_for(path, stream=True))
    assert resp.status == 200
    await resp.read()
    assert_full_lifecycle(plugin, resp.headers["X-Nexus-Stream-Id"])


@pytest.mark.parametrize("cache", [False, True], ids=["direct", "through-the-hub"])
@pytest.mark.parametrize("path", ENDPOINTS)
async def test_hooks_fire_on_a_non_streaming_request(
    hooked: HookedClient, path: str, cache: bool
) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin), config={"cache": {"enabled": cache}})
    resp = await client.post(path, json=body_for(path, stream=False))
    assert resp.status == 200
    assert text_of(path, await resp.json()) == TEXT
    assert_full_lifecycle(plugin)


async def test_a_background_request_fires_them_too(hooked: HookedClient) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin))
    resp = await client.post("/v1/chat/completions", json=chat(TEXT, background=True))
    assert resp.status == 202
    stream_id = (await resp.json())["id"]
    await (await client.get(f"/v1/streams/{stream_id}")).read()
    assert_full_lifecycle(plugin, stream_id)


async def test_a_failure_mid_stream_fires_failed_with_the_error_event(
    hooked: HookedClient,
) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin))
    resp = await client.post(
        "/v1/chat/completions", json=chat(TEXT, stream=True, mock={"fail_after": 2})
    )
    assert resp.status == 200
    await resp.read()
    assert plugin.names() == ["started", "chunk", "chunk", "failed"]
    ((_, request_id, model, error),) = plugin.of("failed")
    assert request_id == resp.headers["X-Nexus-Stream-Id"]
    assert model == "mock/echo"
    assert isinstance(error, Error)
    assert error.code == "upstream_error"


async def test_a_failure_before_output_fires_failed_and_answers_with_its_status(
    hooked: HookedClient,
) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin))
    for stream in (True, False):
        resp = await client.post(
            "/v1/chat/completions", json=chat(TEXT, stream=stream, mock={"fail_after": 0})
        )
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_error"
    assert plugin.names() == ["started", "failed"] * 2
    assert [args[3].code for args in plugin.of("failed")] == ["upstream_error"] * 2


async def test_a_cancelled_stream_fires_failed(hooked: HookedClient) -> None:
    plugin = RecordingPlugin()
    gated = GatedProvider(before=2)
    client = await hooked(hooks_of(plugin), providers=[gated])
    resp = await client.post(
        "/v1/chat/completions", json={**chat(TEXT, background=True), "model": "gated/x"}
    )
    stream_id = (await resp.json())["id"]
    await gated.started.wait()
    deleted = await client.delete(f"/v1/streams/{stream_id}")
    assert deleted.status == 200
    assert plugin.names()[0] == "started"
    assert plugin.names()[-1] == "failed"
    assert "completed" not in plugin.names()
    assert plugin.of("failed")[0][3].code == "stream_cancelled"


# --- chunk_every ----------------------------------------------------------------------------


async def test_chunk_every_n_calls_the_chunk_hook_on_every_nth_chunk(
    hooked: HookedClient,
) -> None:
    every, second, third = RecordingPlugin(), RecordingPlugin(), RecordingPlugin()
    hooks = Hooks()
    hooks.add(every)
    hooks.add(second, chunk_every=2)
    hooks.add(third, chunk_every=3)
    client = await hooked(hooks)
    for _ in range(2):  # the count is per stream
        await (await client.post("/v1/chat/completions", json=chat(TEXT, stream=True))).read()
    sizes = [event_bytes(e) for e in MOCK_EVENTS]
    assert [c[3] for c in every.of("chunk")] == sizes * 2
    assert [c[3] for c in second.of("chunk")] == [sizes[1], sizes[3]] * 2
    assert [(c[2], c[3]) for c in third.of("chunk")] == [("delta", sizes[2])] * 2
    assert second.names().count("completed") == third.names().count("completed") == 2


async def test_no_stream_hooks_means_no_observer() -> None:
    hooks = hooks_of(StartedOnly())
    assert hooks.observe(CallContext(), a_meta()) is None
    assert Hooks().observe(CallContext(), a_meta()) is None
    observer = hooks_of(RecordingPlugin()).observe(CallContext(), a_meta())
    assert observer is not None and observer.chunks


def a_meta() -> StreamMeta:
    return StreamMeta.new("mock/echo", provider="mock", upstream_model="echo")


async def test_an_aborted_end_is_a_failure() -> None:
    plugin = RecordingPlugin()
    observer = hooks_of(plugin).observe(CallContext(), a_meta())
    assert observer is not None
    await observer.end(Done(aborted=True), 0.5, lambda: pytest.fail("not merged"))
    ((_, _, _, error),) = plugin.of("failed")
    assert error.code == "stream_cancelled"
    assert plugin.names() == ["failed"]


async def test_the_hub_passes_the_callers_context(hooked: HookedClient) -> None:
    """What the server's routes do: ``hub.open(..., ctx=...)``."""
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin), middleware=[shout])
    ctx = CallContext(request_id="req_1", key="alice", endpoint="/v1/x", format="text/plain")
    opened = await client.app[HUB].open(
        ChatRequest.model_validate(chat(TEXT)), format="text/plain", owner="alice", ctx=ctx
    )
    assert opened.run is not None
    reader = opened.run.reader()
    await opened.run.wait()
    await reader.close()
    assert plugin.names() == ["started", *["chunk"] * len(KINDS), "completed"]
    assert all(args[0] is ctx and args[1] == opened.id for _, args in plugin.calls)
    assert plugin.of("completed")[0][5].content == TEXT.upper()
    assert ctx.metadata == {"shouted": True}


async def test_the_run_has_no_observer_without_stream_hooks(hooked: HookedClient) -> None:
    client = await hooked(hooks_of(StartedOnly()), providers=[gated := GatedProvider()])
    resp = await client.post(
        "/v1/chat/completions", json={**chat(TEXT, background=True), "model": "gated/x"}
    )
    stream_id = (await resp.json())["id"]
    run = client.app[HUB].live[stream_id]
    assert run._observer is None
    gated.gate.set()
    await run.wait()


# --- a hook that raises ---------------------------------------------------------------------


async def test_a_raising_hook_is_logged_and_counted_and_the_stream_goes_on(
    hooked: HookedClient, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = RecordingPlugin()
    hooks = hooks_of(RaisingPlugin(), recorder)
    client = await hooked(hooks)
    caplog.set_level(logging.ERROR, logger="nexus.hooks")
    resp = await client.post("/v1/chat/completions", json=chat(TEXT, stream=True))
    raw = await resp.read()
    assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert_full_lifecycle(recorder, resp.headers["X-Nexus-Stream-Id"])  # later plugins still run
    assert hooks.errors == Counter(
        {"on_stream_started": 1, "on_chunk_received": len(KINDS), "on_stream_completed": 1}
    )
    failed = await client.post(
        "/v1/chat/completions", json=chat(TEXT, stream=True, mock={"fail_after": 1})
    )
    await failed.read()
    assert hooks.errors["on_stream_failed"] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert "plugin RaisingPlugin raised in on_chunk_received; the stream goes on" in messages
    assert all(r.exc_info is not None for r in caplog.records)
    assert not any("Hello" in m or "there" in m for m in messages)  # no request contents


async def test_a_raising_hook_does_not_fail_a_non_streaming_request(
    hooked: HookedClient,
) -> None:
    hooks = hooks_of(RaisingPlugin())
    client = await hooked(hooks)
    resp = await client.post("/v1/chat/completions", json=chat(TEXT))
    assert resp.status == 200
    assert text_of("/v1/chat/completions", await resp.json()) == TEXT
    assert hooks.errors["on_stream_completed"] == 1


# --- rejection from on_stream_started -------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
@pytest.mark.parametrize("path", ENDPOINTS)
async def test_a_rejection_is_a_403_in_the_endpoints_shape(
    hooked: HookedClient, path: str, stream: bool
) -> None:
    plugin = RecordingPlugin(reject=("stream_rejected", 403))
    gated = GatedProvider()
    client = await hooked(hooks_of(plugin), providers=[gated])
    resp = await client.post(path, json=body_for(path, stream=stream, model="gated/x"))
    assert resp.status == 403
    body = await resp.json()
    if path == "/v1/messages":
        assert body == {
            "type": "error",
            "error": {
                "type": "permission_error",
                "message": "Refused by policy.",
                "details": {"error_code": "stream_rejected"},
            },
            "request_id": resp.headers["X-Request-Id"],
        }
    else:
        assert body == {
            "error": {
                "message": "Refused by policy.",
                "type": "permission_error",
                "param": None,
                "code": "stream_rejected",
                "request_id": resp.headers["X-Request-Id"],
            }
        }
    assert plugin.names() == ["started"]  # nothing else: no stream was made
    await asyncio.sleep(0.01)
    assert not gated.started.is_set()  # nothing went upstream
    assert not client.app[HUB].live


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_a_rejection_carries_the_plugins_code_and_status(
    hooked: HookedClient, path: str
) -> None:
    client = await hooked(hooks_of(RecordingPlugin(reject=("budget_exceeded", 429))))
    resp = await client.post(path, json=body_for(path, stream=True))
    assert resp.status == 429
    body = await resp.json()
    if path == "/v1/messages":
        assert body["error"]["type"] == "rate_limit_error"
    else:
        assert body["error"]["code"] == "budget_exceeded"
        assert body["error"]["type"] == "rate_limit_error"


async def test_a_rejection_refuses_a_background_request_before_the_202(
    hooked: HookedClient,
) -> None:
    plugin = RecordingPlugin(reject=("over_budget", 402))
    client = await hooked(hooks_of(plugin))
    resp = await client.post("/v1/chat/completions", json=chat(TEXT, background=True))
    assert resp.status == 402
    assert "Location" not in resp.headers and "X-Nexus-Stream-Id" not in resp.headers
    assert (await resp.json())["error"]["code"] == "over_budget"
    assert not client.app[HUB].live


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_cache_replays_pass_the_started_hooks_too(hooked: HookedClient, stream: bool) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin), config={"cache": {"enabled": True}})
    first = await client.post("/v1/chat/completions", json=chat(TEXT, stream=stream))
    await first.read()
    assert first.headers["X-Nexus-Cache"] == "miss"
    await client.app[HUB].drain()  # recorded
    replay = await client.post("/v1/chat/completions", json=chat(TEXT, stream=stream))
    await replay.read()
    assert replay.headers["X-Nexus-Cache"] == "hit"
    # The replay is a stream of its own: the whole lifecycle, under its own id.
    half = len(plugin.calls) // 2
    one, two = RecordingPlugin(), RecordingPlugin()
    one.calls, two.calls = plugin.calls[:half], plugin.calls[half:]
    assert assert_full_lifecycle(one) != assert_full_lifecycle(two)
    plugin.reject = ("stream_rejected", 403)
    refused = await client.post("/v1/chat/completions", json=chat(TEXT, stream=stream))
    assert refused.status == 403
    assert (await refused.json())["error"]["code"] == "stream_rejected"
    assert plugin.names()[-1] == "started"


async def test_a_joining_request_gets_started_only(hooked: HookedClient) -> None:
    plugin = RecordingPlugin()
    gated = GatedProvider()
    client = await hooked(hooks_of(plugin), config={"cache": {"enabled": True}}, providers=[gated])
    body = {**chat(TEXT, stream=True), "model": "gated/x"}
    first = await client.post("/v1/chat/completions", json=body)
    await gated.started.wait()
    second = await client.post("/v1/chat/completions", json=body)
    assert second.headers["X-Nexus-Cache"] == "hit"
    gated.gate.set()
    await first.read()
    await second.read()
    assert plugin.names().count("started") == 2
    assert plugin.names().count("completed") == 1
    assert plugin.of("completed")[0][1] == first.headers["X-Nexus-Stream-Id"]
    # A joiner is refused like anyone else.
    plugin.reject = ("stream_rejected", 403)
    gated.gate.clear()
    gated.started.clear()
    third = await client.post("/v1/chat/completions", json=body)
    assert third.status == 403


# --- middleware -----------------------------------------------------------------------------


async def shout(ctx: CallContext, request: ChatRequest, call_next: Next) -> Stream:
    """Changes the request: the user's text in capitals (a copy; the original is kept)."""
    message = request.messages[-1]
    text = str(message.content).upper()
    changed = request.model_copy(
        update={"messages": [*request.messages[:-1], message.model_copy(update={"content": text})]}
    )
    ctx.metadata["shouted"] = True
    return await call_next(changed)


async def no_usage(ctx: CallContext, request: ChatRequest, call_next: Next) -> Stream:
    """Filters events: drops usage, brackets content."""

    def edit(event: StreamEvent) -> StreamEvent | None:
        if isinstance(event, Usage):
            return None
        if isinstance(event, Delta) and event.content:
            return Delta(content=f"[{event.content}]")
        return event

    return map_stream(await call_next(request), edit)


async def gatekeeper(ctx: CallContext, request: ChatRequest, call_next: Next) -> Stream:
    """Refuses a model."""
    if request.model == "mock/forbidden":
        raise InvalidRequest("That model is not for you.", code="model_refused", param="model")
    return await call_next(request)


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_middleware_changes_the_request_the_same_for_stream_and_not(
    hooked: HookedClient, path: str
) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin), middleware=[shout])
    plain = await client.post(path, json=body_for(path, stream=False))
    assert text_of(path, await plain.json()) == TEXT.upper()
    streamed = await client.post(path, json=body_for(path, stream=True))
    await streamed.read()
    assert [args[5].content for args in plugin.of("completed")] == [TEXT.upper()] * 2
    assert all(args[0].metadata == {"shouted": True} for _, args in plugin.calls)


async def test_middleware_filters_events_the_same_for_stream_and_not(
    hooked: HookedClient,
) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin), middleware=[no_usage])
    plain = await client.post("/v1/chat/completions", json=chat(TEXT))
    data = await plain.json()
    assert data["choices"][0]["message"]["content"] == "[Hello][ there][ world]"
    assert data["usage"]["total_tokens"] == 0  # the usage event was dropped
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson",
        json=chat(TEXT, stream=True, stream_options={"include_usage": True}),
    )
    lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert "".join(
        line["delta"].get("content") or "" for line in lines if line["type"] == "delta"
    ) == ("[Hello][ there][ world]")
    assert not [line for line in lines if line["type"] == "usage"]
    # Hooks see what the middleware returned: 4 chunks, no usage, twice.
    assert [c[2] for c in plugin.of("chunk")] == ["delta"] * 8
    assert [args[5].usage for args in plugin.of("completed")] == [None, None]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_middleware_refuses_a_request_in_the_endpoints_shape(
    hooked: HookedClient, path: str, stream: bool
) -> None:
    plugin = RecordingPlugin()
    client = await hooked(hooks_of(plugin), middleware=[gatekeeper, shout])
    resp = await client.post(path, json=body_for(path, stream=stream, model="mock/forbidden"))
    assert resp.status == 400
    body = await resp.json()
    if path == "/v1/messages":
        assert body["type"] == "error"
        assert body["error"] == {
            "type": "invalid_request_error",
            "message": "That model is not for you.",
            "details": {"error_code": "model_refused"},
        }
    else:
        assert body["error"]["code"] == "model_refused"
        assert body["error"]["param"] == "model"
    assert plugin.calls == []  # refused before the stream existed


async def test_middleware_runs_in_order_first_outermost() -> None:
    seen: list[str] = []

    def tag(name: str) -> Middleware:
        async def middleware(ctx: CallContext, request: ChatRequest, call_next: Next) -> Stream:
            seen.append(f"{name} in")
            stream = await call_next(request)
            seen.append(f"{name} out")
            return stream

        return middleware

    engine = Engine([MockProvider("mock")], middleware=[tag("a"), tag("b")])
    assert (await engine.complete(chat(TEXT))).content == TEXT
    assert seen == ["a in", "b in", "b out", "a out"]


# --- plugins from config.toml ---------------------------------------------------------------


async def test_plugins_load_from_config_with_options_and_chunk_every(
    make_client: MakeClient,
) -> None:
    LOADED.clear()
    client = await make_client(
        {
            "plugins": [
                {"path": "test_hooks:RecordingPlugin", "options": {"name": "all"}},
                {
                    "path": "test_hooks:make_plugin",
                    "options": {"name": "halves"},
                    "chunk_every": 2,
                },
            ]
        }
    )
    resp = await client.post("/v1/chat/completions", json=chat(TEXT, stream=True))
    await resp.read()
    assert_full_lifecycle(LOADED["all"], resp.headers["X-Nexus-Stream-Id"])
    assert [c[2] for c in LOADED["halves"].of("chunk")] == ["delta", "delta"]
    hooks = client.app[ENGINE].hooks
    assert len(hooks) == 3  # the two, and the built-in metrics plugin
    with pytest.raises(RegistryFrozen):  # the engine started
        hooks.add(RecordingPlugin())


def test_a_ready_plugin_object_loads_as_is_and_takes_no_options() -> None:
    hooks = Hooks()
    hooks.load([PluginConfig(path="test_hooks:READY")])
    assert hooks.plugins == [READY]
    with pytest.raises(ConfigError, match=r"\[\[plugins\]\] #1 path: .*takes no options"):
        Hooks().load([PluginConfig(path="test_hooks:READY", options={"name": "x"})])


@pytest.mark.parametrize(
    ("path", "options", "problem"),
    [
        ("no_such_module_here:Plugin", {}, "cannot import module 'no_such_module_here'"),
        ("test_hooks:NoSuchPlugin", {}, "has no attribute 'NoSuchPlugin'"),
        ("test_hooks:RecordingPlugin", {"colour": "red"}, "could not be built with its options"),
        ("test_hooks:MOCK_EVENTS", {}, "none of the hooks"),
    ],
)
def test_a_bad_plugin_is_a_config_error_naming_it(
    path: str, options: dict[str, Any], problem: str
) -> None:
    config = parse_config(
        {"plugins": [{"path": "test_hooks:StartedOnly"}, {"path": path, "options": options}]}
    )
    with pytest.raises(ConfigError) as info:
        Engine.from_config(config)
    message = str(info.value)
    assert message.startswith("[[plugins]] #2 path: ")
    assert problem in message
    with pytest.raises(ConfigError, match=r"^config\.toml: \[\[plugins\]\] #2 path"):
        Hooks().load(config.plugins, "config.toml")


def test_create_app_refuses_a_bad_plugin() -> None:
    with pytest.raises(ConfigError, match=r"\[\[plugins\]\] #1 path"):
        create_app(parse_config({"plugins": [{"path": "no_such_module_here:P"}]}))


# --- the Python API -------------------------------------------------------------------------


async def test_engine_complete_fires_every_hook_and_runs_the_middleware() -> None:
    plugin = RecordingPlugin()
    engine = Engine([MockProvider("mock")], hooks=hooks_of(plugin), middleware=[shout])
    async with engine:
        ctx = CallContext(key="alice", endpoint="python")
        completion = await engine.complete(chat(TEXT), ctx)
    assert completion.content == TEXT.upper()
    assert plugin.names() == ["started", *["chunk"] * len(KINDS), "completed"]
    assert all(args[0] is ctx for _, args in plugin.calls)
    assert plugin.of("completed")[0][5].content == TEXT.upper()
    assert plugin.of("started")[0][1] == completion.id
    assert ctx.metadata == {"shouted": True}


async def test_engine_open_stream_fires_hooks_as_it_is_read() -> None:
    plugin = RecordingPlugin()
    engine = Engine([MockProvider("mock")], hooks=hooks_of(plugin, chunk_every=2))
    stream = await engine.open_stream(chat(TEXT))
    assert plugin.names() == ["started"]  # before the first read
    events = [event async for event in stream]
    assert events == MOCK_EVENTS
    assert plugin.names() == ["started", "chunk", "chunk", "completed"]
    assert isinstance(plugin.of("started")[0][0], CallContext)  # a default context


async def test_engine_stream_closed_early_fires_failed() -> None:
    plugin = RecordingPlugin()
    engine = Engine([MockProvider("mock")], hooks=hooks_of(plugin))
    async with await engine.open_stream(chat(TEXT)) as stream:
        await stream.next()
    assert plugin.names() == ["started", "chunk", "failed"]
    assert plugin.of("failed")[0][3].code == "stream_cancelled"


async def test_engine_failures_fire_failed() -> None:
    plugin = RecordingPlugin()
    engine = Engine([MockProvider("mock")], hooks=hooks_of(plugin))
    with pytest.raises(StreamError):
        await engine.complete(chat(TEXT, mock={"fail_after": 1}))
    assert plugin.names() == ["started", "chunk", "failed"]
    assert plugin.of("failed")[0][3].code == "upstream_error"
    with pytest.raises(GatewayError) as info:
        await engine.complete(chat(TEXT, mock={"fail_after": 0}))
    assert info.value.code == "upstream_error"
    assert plugin.names()[-2:] == ["started", "failed"]


async def test_engine_rejection_raises_and_nothing_streams() -> None:
    plugin = RecordingPlugin(reject=("budget_exceeded", 429))
    gated = GatedProvider()
    engine = Engine([gated], hooks=hooks_of(plugin))
    with pytest.raises(StreamRejected) as info:
        await engine.open_stream({**chat(TEXT), "model": "gated/x"})
    assert (info.value.status, info.value.code) == (429, "budget_exceeded")
    assert info.value.error_type == "rate_limit_error"
    assert plugin.names() == ["started"]
    assert not gated.started.is_set()


async def test_complete_stream_runs_the_middleware_and_the_hooks() -> None:
    plugin = RecordingPlugin()
    engine = Engine([MockProvider("mock")], hooks=hooks_of(plugin), middleware=[no_usage])
    async with engine:
        stream = engine.complete_stream(chat(TEXT), CallContext(key="alice"))
        assert plugin.calls == []  # nothing runs before the first read
        completion = await accumulate(stream)
    assert completion.content == "".join(f"[{w}]" for w in words(TEXT))
    assert completion.usage is None  # the middleware dropped it
    assert plugin.names()[0] == "started" and plugin.names()[-1] == "completed"
    assert "chunk" in plugin.names()
    started = plugin.of("started")[0]
    assert started[0].key == "alice" and started[1] == stream.meta.id


async def test_complete_stream_refused_by_a_plugin_raises_at_the_first_read() -> None:
    plugin = RecordingPlugin(reject=("budget_exceeded", 429))
    gated = GatedProvider()
    engine = Engine([gated], hooks=hooks_of(plugin))
    stream = engine.complete_stream({**chat(TEXT), "model": "gated/x"})
    with pytest.raises(StreamRejected):
        await stream.next()
    assert not gated.started.is_set()


async def test_map_stream_closes_the_inner_stream() -> None:
    gated = GatedProvider(before=3)
    engine = Engine([gated])
    inner = engine.complete_stream({**chat(TEXT), "model": "gated/x"})
    outer = map_stream(
        inner, lambda e: None if isinstance(e, Delta) and e.content == "before1 " else e
    )
    assert outer.meta is inner.meta
    assert [await outer.next(), await outer.next()] == [
        Delta(content="before0 "),
        Delta(content="before2 "),
    ]
    await outer.close()
    assert gated.closed.is_set()


def test_add_checks_the_plugin() -> None:
    hooks = Hooks()
    with pytest.raises(TypeError, match="none of the hooks"):
        hooks.add(object())
    with pytest.raises(ValueError, match="chunk_every"):
        hooks.add(RecordingPlugin(), chunk_every=0)
    with pytest.raises(TypeError, match="not callable"):
        hooks.add(type("Odd", (), {"on_stream_started": 3})())
    # A class, not an instance: every call raised, logged, and a gate let requests through.
    with pytest.raises(TypeError, match="is a class: add an instance"):
        hooks.add(StartedOnly)

    # A misspelt hook beside a right one: accepted, and never called.
    async def hook(self: object, *args: object, **kwargs: object) -> None: ...

    misspelt = type("Misspelt", (), {"on_stream_started": hook, "on_stream_complete": hook})
    with pytest.raises(TypeError, match="on_stream_complete is none of"):
        hooks.add(misspelt())
    assert not hooks
    hooks.add(StartedOnly())
    assert hooks and len(hooks) == 1


def test_stream_rejected_defaults() -> None:
    error = StreamRejected("No.")
    assert (error.status, error.code, error.error_type) == (
        403,
        "stream_rejected",
        "permission_error",
    )
    assert StreamRejected("Budget.", status=402).error_type == "permission_error"
    assert StreamRejected("Slow down.", status=429).error_type == "rate_limit_error"
    assert StreamRejected("x", status=429, error_type="insufficient_quota").error_type == (
        "insufficient_quota"
    )
    assert isinstance(error, GatewayError)


async def test_map_stream_gives_the_events_before_the_one_it_fails_on() -> None:
    async def one_read() -> AsyncGenerator[list[StreamEvent], None]:
        yield [Delta(content="a"), Delta(content="b"), Delta(content="boom"), Delta(content="c")]

    def edit(event: StreamEvent) -> StreamEvent:
        if isinstance(event, Delta) and event.content == "boom":
            raise ValueError("boom")
        return event

    mapped = map_stream(Stream.of_batches(one_read(), StreamMeta.new("m")), edit)
    got = []
    with pytest.raises(ValueError, match="boom"):
        async for event in mapped:
            got.append(event)
    assert got == [Delta(content="a"), Delta(content="b")]


async def test_a_cancel_while_the_end_hooks_run_does_not_cut_them(hooked: HookedClient) -> None:
    """The stream's end is decided once its end hooks start: a client leaving (or any
    cancel) then changes neither the hooks nor the end."""
    entered, gate = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    class Slow:
        async def on_stream_completed(self, *args: object) -> None:
            entered.set()
            await gate.wait()
            finished.append("completed")

    client = await hooked(hooks_of(Slow()))
    hub = client.app[HUB]
    opened = await hub.open(ChatRequest.model_validate(chat(TEXT)), format="text/plain")
    assert opened.run is not None
    run = opened.run
    reader = run.reader()
    await asyncio.wait_for(entered.wait(), 5)
    run.cancel(Error(error_type="server_error", message="gone", code="client_disconnect"))
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.wait_for(run.wait(), 5)
    await reader.close()
    assert finished == ["completed"]
    assert run.events[-1] == Done()

"""Engine: routing, aliases and fallback, the failure contract, lifecycle, stream metadata."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest

from nexus import Engine, MockProvider, Provider
from nexus.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    UpstreamError,
    UpstreamTimeout,
)
from nexus.events import Delta, Error, StreamEvent
from nexus.request import ChatRequest
from nexus.stream import EndOfStream, Stream
from nexus.types import Completion


class Scripted(Provider):
    """Yields ``events``; raises ``fail`` once ``fail_at`` events went out. Records everything."""

    kind = "scripted"

    def __init__(
        self,
        name: str,
        events: Sequence[StreamEvent] = (),
        *,
        fail: BaseException | None = None,
        fail_at: int = 0,
        models: list[str] | None = None,
        log: list[str] | None = None,
    ) -> None:
        super().__init__(name, models)
        self.events = list(events)
        self.fail = fail
        self.fail_at = fail_at
        self.calls: list[str] = []
        self.log = log if log is not None else []

    async def start(self) -> None:
        self.log.append(f"start {self.name}")

    async def close(self) -> None:
        self.log.append(f"close {self.name}")

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        self.calls.append(model)
        try:
            for i, event in enumerate(self.events):
                if self.fail is not None and i == self.fail_at:
                    raise self.fail
                yield [event]
            if self.fail is not None:
                raise self.fail
        finally:
            self.log.append(f"finally {self.name}")


def chat(model: str = "mock/echo", content: str = "hi there", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def read_all(stream: Stream) -> list[StreamEvent]:
    async with stream:
        return [e async for e in stream]


A_EVENTS: list[StreamEvent] = [Delta(content="from a"), Delta(finish_reason="stop")]
B_EVENTS: list[StreamEvent] = [Delta(content="from b"), Delta(finish_reason="stop")]


# --- routing -----------------------------------------------------------------


async def test_provider_slash_model_routes_to_that_provider() -> None:
    p = Scripted("mock", A_EVENTS)
    engine = Engine([p, Scripted("other", B_EVENTS)])
    assert engine.route("mock/anything") == [(p, "anything")]
    stream = engine.complete_stream(chat("mock/anything"))
    assert stream.meta.provider == "mock"
    assert stream.meta.upstream_model == "anything"
    assert stream.meta.model == "mock/anything"
    assert await read_all(stream) == A_EVENTS
    assert p.calls == ["anything"]


async def test_upstream_model_keeps_further_slashes() -> None:
    p = Scripted("mock", A_EVENTS)
    engine = Engine([p])
    stream = engine.complete_stream(chat("mock/org/model-7b"))
    assert stream.meta.upstream_model == "org/model-7b"
    assert await read_all(stream) == A_EVENTS
    assert p.calls == ["org/model-7b"]


@pytest.mark.parametrize("model", ["nope/x", "noslash", "mock/", "/x", "fast/x"])
def test_unknown_model_raises_model_not_found_synchronously(model: str) -> None:
    engine = Engine([MockProvider("mock")], models={"fast": ["mock/x"]})
    with pytest.raises(ModelNotFound) as info:
        engine.complete_stream(chat(model))
    exc = info.value
    assert exc.status == 404
    assert exc.code == "model_not_found"
    assert exc.param == "model"
    assert repr(model) in exc.message


def test_empty_model_in_a_request_object_raises_model_not_found() -> None:
    engine = Engine([MockProvider("mock")])
    request = ChatRequest.model_construct(model="", messages=[])
    with pytest.raises(ModelNotFound) as info:
        engine.complete_stream(request)
    assert info.value.param == "model"


async def test_alias_routes_to_its_first_target() -> None:
    a, b = Scripted("a", A_EVENTS), Scripted("b", B_EVENTS)
    engine = Engine([a, b], models={"fast": ["a/x", "b/y"]})
    assert engine.route("fast") == [(a, "x"), (b, "y")]
    stream = engine.complete_stream(chat("fast"))
    assert (stream.meta.model, stream.meta.provider, stream.meta.upstream_model) == (
        "fast",
        "a",
        "x",
    )
    assert await read_all(stream) == A_EVENTS
    assert (a.calls, b.calls) == (["x"], [])


@pytest.mark.parametrize("target", ["ghost/x", "a", "a/"])
def test_alias_target_naming_no_provider_fails_at_construction(target: str) -> None:
    with pytest.raises(ValueError, match=r"models\.fast") as info:
        Engine([Scripted("a")], models={"fast": ["a/ok", target]})
    assert repr(target) in str(info.value)


def test_providers_may_be_a_mapping_of_their_names() -> None:
    p = Scripted("a")
    engine = Engine({"a": p})
    assert engine.providers == {"a": p}


# --- the failure contract ----------------------------------------------------


@pytest.mark.parametrize("error", [UpstreamError("down"), UpstreamTimeout("slow")])
async def test_retryable_error_before_output_falls_back(error: GatewayError) -> None:
    a = Scripted("a", A_EVENTS, fail=error, fail_at=0)
    b = Scripted("b", B_EVENTS)
    engine = Engine([a, b], models={"fast": ["a/x", "b/y"]})
    assert await read_all(engine.complete_stream(chat("fast"))) == B_EVENTS
    assert (a.calls, b.calls) == (["x"], ["y"])
    assert a.log == ["finally a"]


async def test_retryable_error_on_the_last_target_is_raised() -> None:
    a = Scripted("a", fail=UpstreamError("a down"))
    b = Scripted("b", fail=UpstreamError("b down"))
    engine = Engine([a, b], models={"fast": ["a/x", "b/y"]})
    stream = engine.complete_stream(chat("fast"))
    with pytest.raises(UpstreamError, match="b down"):
        await stream.next()
    await stream.close()
    assert (a.calls, b.calls) == (["x"], ["y"])


async def test_non_retryable_error_before_output_is_raised_without_fallback() -> None:
    a = Scripted("a", A_EVENTS, fail=InvalidRequest("bad field", param="temperature"))
    b = Scripted("b", B_EVENTS)
    engine = Engine([a, b], models={"fast": ["a/x", "b/y"]})
    stream = engine.complete_stream(chat("fast"))
    with pytest.raises(InvalidRequest) as info:
        await stream.next()
    assert info.value.param == "temperature"
    assert b.calls == []
    with pytest.raises(EndOfStream):
        await stream.next()


async def test_foreign_exception_before_output_is_a_gateway_error_without_fallback() -> None:
    """A provider's own bug reached the caller raw (a KeyError), not the GatewayError the
    docs promise for a failure before the first event."""
    a = Scripted("a", fail=KeyError("oops"))
    b = Scripted("b", B_EVENTS)
    engine = Engine([a, b], models={"fast": ["a/x", "b/y"]})
    stream = engine.complete_stream(chat("fast"))
    with pytest.raises(GatewayError) as raised:
        await stream.next()
    assert (raised.value.code, raised.value.status) == ("internal_error", 500)
    assert isinstance(raised.value.__cause__, KeyError)
    assert b.calls == []


async def test_error_after_first_event_becomes_the_last_event() -> None:
    a = Scripted("a", A_EVENTS, fail=UpstreamError("lost", code="upstream_reset"), fail_at=1)
    b = Scripted("b", B_EVENTS)
    engine = Engine([a, b], models={"fast": ["a/x", "b/y"]})
    stream = engine.complete_stream(chat("fast"))
    assert await stream.next() == A_EVENTS[0]
    error = await stream.next()
    assert error == Error(
        error_type="upstream_error", message="lost", code="upstream_reset", retryable=True
    )
    with pytest.raises(EndOfStream):
        await stream.next()
    assert b.calls == []
    assert a.log == ["finally a"]


async def test_foreign_exception_after_output_becomes_internal_error_event() -> None:
    a = Scripted("a", A_EVENTS, fail=ZeroDivisionError("x"), fail_at=1)
    engine = Engine([a])
    events = await read_all(engine.complete_stream(chat("a/x")))
    assert events[0] == A_EVENTS[0]
    assert len(events) == 2
    error = events[1]
    assert isinstance(error, Error)
    assert error.code == "internal_error"
    assert error.error_type == "server_error"
    assert error.retryable is True
    assert "'a'" in error.message


# --- requests as dicts, complete() -------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "mock/echo", "messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        (chat(temperature=5), "temperature"),
        (chat(max_tokens=-1), "max_tokens"),
    ],
)
def test_invalid_dict_raises_invalid_request_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    engine = Engine([MockProvider("mock")])
    with pytest.raises(InvalidRequest) as info:
        engine.complete_stream(body)
    assert info.value.param == param
    assert info.value.status == 400
    assert info.value.message.startswith(param)


def test_complete_stream_does_not_mutate_the_callers_dict() -> None:
    body = chat(stream_options={"include_usage": True})
    before = repr(body)
    Engine([MockProvider("mock")]).complete_stream(body)
    assert repr(body) == before


async def test_complete_returns_a_completion() -> None:
    engine = Engine([MockProvider("mock")])
    result = await engine.complete(chat("mock/echo", "Hello there world"))
    assert isinstance(result, Completion)
    assert result.content == "Hello there world"
    assert result.model == "mock/echo"
    assert result.finish_reason == "stop"
    assert result.usage is not None
    assert result.usage.completion_tokens == 3
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", result.id)


async def test_complete_accepts_a_chat_request() -> None:
    engine = Engine([MockProvider("mock")])
    result = await engine.complete(ChatRequest.model_validate(chat(content="a b")))
    assert result.content == "a b"


# --- models, lifecycle -------------------------------------------------------


def test_models_lists_aliases_then_provider_models() -> None:
    engine = Engine(
        [MockProvider("mock"), Scripted("b", models=["big", "small"])],
        models={"fast": ["mock/x"], "smart": ["b/big"]},
    )
    assert engine.models() == ["fast", "smart", "mock/echo", "b/big", "b/small"]


async def test_start_and_close_reach_every_provider() -> None:
    log: list[str] = []
    engine = Engine([Scripted("a", log=log), Scripted("b", log=log)])
    await engine.start()
    assert log == ["start a", "start b"]
    await engine.close()
    assert log == ["start a", "start b", "close a", "close b"]


async def test_async_with_starts_and_closes() -> None:
    log: list[str] = []
    async with Engine([Scripted("a", A_EVENTS, log=log)]) as engine:
        assert log == ["start a"]
        assert await read_all(engine.complete_stream(chat("a/x"))) == A_EVENTS
    assert log == ["start a", "finally a", "close a"]


async def test_failed_start_closes_the_providers_already_started() -> None:
    log: list[str] = []

    class Broken(Scripted):
        async def start(self) -> None:
            raise OSError("no socket")

    engine = Engine([Scripted("a", log=log), Broken("b", log=log), Scripted("c", log=log)])
    with pytest.raises(OSError, match="no socket"):
        await engine.start()
    assert log == ["start a", "close a"]


async def test_close_goes_on_after_a_provider_fails_to_close() -> None:
    log: list[str] = []

    class Broken(Scripted):
        async def close(self) -> None:
            raise OSError("stuck")

    engine = Engine([Broken("a", log=log), Scripted("b", log=log)])
    await engine.close()
    assert log == ["close b"]


# --- stream metadata ---------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, False),
        ({"stream_options": {"include_usage": False}}, False),
        ({"stream_options": {"include_usage": True}}, True),
    ],
)
def test_meta_include_usage_follows_stream_options(extra: dict[str, Any], expected: bool) -> None:
    engine = Engine([MockProvider("mock")])
    assert engine.complete_stream(chat(**extra)).meta.include_usage is expected


def test_meta_carries_retry_ms() -> None:
    engine = Engine([MockProvider("mock")], retry_ms=1500)
    assert engine.complete_stream(chat()).meta.retry_ms == 1500


def test_meta_ids_have_128_random_bits_and_differ() -> None:
    engine = Engine([MockProvider("mock")])
    ids = [engine.complete_stream(chat()).meta.id for _ in range(50)]
    for stream_id in ids:
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", stream_id)
    assert len(set(ids)) == 50


class Batched(Provider):
    """Yields the given batches as they are; records its cleanup."""

    kind = "batched"

    def __init__(self, name: str, batches: Sequence[list[StreamEvent]]) -> None:
        super().__init__(name)
        self.script = [list(batch) for batch in batches]
        self.closed = False

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        try:
            for batch in self.script:
                yield batch
        finally:
            self.closed = True


REFUSED = Error(error_type="server_error", message="upstream said no", code="upstream_error")


async def test_an_error_a_provider_yields_ends_the_stream_and_is_counted() -> None:
    """Events a provider yielded after its Error reached the reader, though the Error is
    the last event; and the failure never reached ``on_upstream_error``."""
    after = Delta(content=" after the error")
    a = Batched("a", [[Delta(content="part")], [REFUSED, after], [after]])
    engine = Engine([a])
    failed: list[tuple[str, str]] = []
    engine.on_upstream_error = lambda provider, code: failed.append((provider, code))
    stream = engine.complete_stream(chat("a/x"))
    assert await stream.next() == Delta(content="part")
    assert await stream.next() == REFUSED
    assert a.closed  # at the error, not when the reader gets to the end
    with pytest.raises(EndOfStream):
        await stream.next()
    assert failed == [("a", "upstream_error")]


async def test_an_error_yielded_in_the_first_read_after_output_keeps_the_output() -> None:
    a = Batched("a", [[Delta(content="part"), REFUSED, Delta(content="dropped")]])
    assert await read_all(Engine([a]).complete_stream(chat("a/x"))) == [
        Delta(content="part"),
        REFUSED,
    ]


async def test_an_error_a_provider_yields_first_is_raised_after_the_fallbacks() -> None:
    """Before any output a yielded Error is what a raised one is: the next target is
    tried when it is retryable, and it is counted."""
    retry = Error(error_type="server_error", message="busy", code="upstream_error", retryable=True)
    a = Batched("a", [[retry], [Delta(content="never")]])
    b = Batched("b", [[REFUSED]])
    engine = Engine([a, b], models={"fast": ["a/x", "b/y"]})
    failed: list[tuple[str, str]] = []
    engine.on_upstream_error = lambda provider, code: failed.append((provider, code))
    stream = engine.complete_stream(chat("fast"))
    with pytest.raises(GatewayError) as raised:
        await stream.next()
    assert (raised.value.code, raised.value.message) == ("upstream_error", "upstream said no")
    assert failed == [("a", "upstream_error"), ("b", "upstream_error")]
    assert a.closed and b.closed


def test_an_engine_used_on_another_event_loop_says_so() -> None:
    """Its providers' connections belong to the loop it started on: from another, every
    call failed with a bare ``RuntimeError: Event loop is closed``."""
    engine = Engine([MockProvider("mock")])
    asyncio.run(engine.start())

    async def use() -> None:
        await engine.complete(chat())

    with pytest.raises(RuntimeError, match=r"started on another event loop.*each loop"):
        asyncio.run(use())


@pytest.mark.parametrize(
    ("providers", "models", "says"),
    [
        ({"openai": MockProvider("mock")}, None, "'openai' maps to the provider 'mock'"),
        ([MockProvider("mock"), MockProvider("mock")], None, "a name of its own"),
        ([MockProvider("my/mock")], None, "without '/'"),
        ([MockProvider("mock")], {"smart": []}, "models.smart: no target"),
    ],
)
def test_an_engine_that_could_not_route_what_it_was_given_is_refused(
    providers: Any, models: Any, says: str
) -> None:
    """Each was accepted: a mapping's key ignored (``openai/...`` then model_not_found), a
    provider of the same name silently dropped, a name no model can name, and an alias
    with no target (StopIteration from every request, a 500 through the server)."""
    with pytest.raises(ValueError, match=re.escape(says)):
        Engine(providers, models)


class RaisingAtOnce(Provider):
    """A provider whose ``batches`` is a plain function that raises before any iterator."""

    kind = "raising"

    def __init__(self, name: str, error: Exception) -> None:
        super().__init__(name)
        self.error = error

    def batches(self, request: ChatRequest, model: str) -> Any:
        raise self.error


@pytest.mark.parametrize(
    ("error", "raised"),
    [(UpstreamError("down"), None), (KeyError("bug"), "internal_error")],
)
async def test_a_provider_that_raises_before_its_stream_fails_like_one_that_raises_in_it(
    error: Exception, raised: str | None
) -> None:
    """A retryable error falls back to the next target, and a bug is the gateway's
    ``internal_error``: raised as ``batches`` was called, the first was a 502 without the
    fallback and the second escaped as it was."""
    b = Scripted("b", B_EVENTS)
    engine = Engine([RaisingAtOnce("a", error), b], models={"fast": ["a/x", "b/y"]})
    stream = engine.complete_stream(chat("fast"))
    if raised is None:
        assert await read_all(stream) == B_EVENTS
        return
    with pytest.raises(GatewayError) as info:
        await stream.next()
    await stream.close()
    assert info.value.code == raised
    assert b.calls == []

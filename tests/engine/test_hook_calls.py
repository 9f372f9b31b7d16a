"""Each hook call is bounded and contained (nexus.hook_calls), from the Python API."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from nexus import Engine, GatewayError, Hooks, MockProvider, accumulate
from nexus.hook_calls import guarded
from nexus.pricing import Price, PriceTable, Spend
from support import chat


class Ends:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    async def on_stream_completed(self, *args: Any) -> None:
        self.log.append(self.name)


class CancelInCompleted:
    async def on_stream_completed(self, *args: Any) -> None:
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        await future  # as a shared future another task cancelled


class Hang:
    async def on_stream_completed(self, *args: Any) -> None:
        await asyncio.sleep(3600)


async def test_a_hooks_own_cancelled_error_is_a_hook_error_not_the_callers() -> None:
    """A ``CancelledError`` out of an end hook cancelled the caller's read (and skipped
    every hook after it) though nobody cancelled the caller."""
    ends: list[str] = []
    hooks = Hooks()
    hooks.add(CancelInCompleted())
    hooks.add(Ends(ends, "after"))
    async with Engine([MockProvider("mock")], hooks=hooks) as engine:
        completion = await accumulate(engine.complete_stream(chat("one two")))
    assert completion.content == "one two"
    assert ends == ["after"]
    assert hooks.errors["on_stream_completed"] == 1
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_hook_past_its_timeout_is_abandoned_and_counted() -> None:
    ends: list[str] = []
    hooks = Hooks()
    hooks.add(Hang(), timeout_s=0.1)
    hooks.add(Ends(ends, "after"))
    async with Engine([MockProvider("mock")], hooks=hooks) as engine:
        began = time.monotonic()
        await asyncio.wait_for(accumulate(engine.complete_stream(chat())), 5)
    assert time.monotonic() - began < 2
    assert ends == ["after"]
    assert hooks.errors["on_stream_completed"] == 1


def test_plugins_added_first_run_before_the_others_in_their_own_order() -> None:
    log: list[str] = []
    hooks = Hooks()
    hooks.add(Ends(log, "user"))
    hooks.add(Ends(log, "budgets"), first=True)
    hooks.add(Ends(log, "metrics"), first=True)
    assert [plugin.name for plugin in hooks.plugins] == ["budgets", "metrics", "user"]  # type: ignore[attr-defined]
    assert [name for name, *_ in hooks._completed] == ["Ends"] * 3
    order = [hook.__self__.name for _, hook, *_ in hooks._completed]
    assert order == ["budgets", "metrics", "user"]


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Hooks().add(Hang(), timeout_s=0)


async def test_a_cancellation_of_the_task_itself_still_goes_through() -> None:
    entered = asyncio.Event()
    failures: list[str] = []

    async def hook() -> None:
        entered.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(guarded(hook, 10, lambda what, trace: failures.append(what)))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert failures == []


async def test_a_plain_function_that_raises_when_called_is_contained() -> None:
    failures: list[str] = []

    def hook() -> Any:
        raise TypeError("wrong signature")

    await guarded(hook, 1, lambda what, trace: failures.append(what))
    assert failures == ["raised"]


class Exits:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def on_stream_started(self, *args: Any) -> None:
        raise self.exc

    async def on_stream_completed(self, *args: Any, **kwargs: Any) -> None:
        raise self.exc


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()], ids=["exit", "interrupt"])
async def test_a_hook_raising_system_exit_is_a_hook_error_not_the_gateways_end(
    exc: BaseException,
) -> None:
    """One plugin calling ``sys.exit()`` took the whole gateway down with it."""
    ends: list[str] = []
    hooks = Hooks()
    hooks.add(Exits(exc))
    hooks.add(Ends(ends, "after"))
    async with Engine([MockProvider("mock")], hooks=hooks) as engine:
        completion = await accumulate(engine.complete_stream(chat("one two")))
    assert completion.content == "one two"
    assert ends == ["after"]
    assert hooks.errors == {"on_stream_started": 1, "on_stream_completed": 1}


class SyncHooks:
    def on_stream_completed(self, *args: Any) -> None:
        pass


class AsyncCallable:
    async def __call__(self, *args: Any) -> None:
        pass


class CallableHook:
    on_stream_completed = AsyncCallable()


def test_a_plain_function_hook_is_refused_when_added() -> None:
    """A sync hook ran, then failed at every call (its None awaited) as a hook error."""
    hooks = Hooks()
    with pytest.raises(TypeError, match=r"SyncHooks: on_stream_completed must be .*async def"):
        hooks.add(SyncHooks())
    assert not hooks
    hooks.add(CallableHook())  # an object with an async __call__ is a coroutine function too
    assert len(hooks) == 1


class Spends:
    def __init__(self) -> None:
        self.costs: list[float | None] = []

    async def on_stream_completed(self, *args: Any, spend: Spend) -> None:
        self.costs.append(spend.cost_usd)


async def test_one_hooks_shared_by_two_engines_prices_with_each_engines_own_table() -> None:
    """The last engine made set its prices on the shared hooks: both engines' spends
    were priced with them."""
    spends = Spends()
    hooks = Hooks()
    hooks.add(spends)
    one, thousand = Price(1.0, 1.0, 1.0), Price(1000.0, 1000.0, 1000.0)
    cheap = Engine([MockProvider("mock")], hooks=hooks, prices=PriceTable({"mock/echo": one}))
    dear = Engine([MockProvider("mock")], hooks=hooks, prices=PriceTable({"mock/echo": thousand}))
    async with cheap, dear:
        await accumulate(cheap.complete_stream(chat("a b c d")))
        await accumulate(dear.complete_stream(chat("a b c d")))
    cheap_cost, dear_cost = spends.costs
    assert cheap_cost is not None and dear_cost is not None and cheap_cost > 0
    assert dear_cost == pytest.approx(cheap_cost * 1000)


class SlowStart:
    async def on_stream_started(self, *args: Any) -> None:
        await asyncio.sleep(3600)


class RaisingStart:
    async def on_stream_started(self, *args: Any) -> None:
        raise RuntimeError("broken")


async def test_the_log_says_what_a_failed_start_hook_does_to_its_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An abandoned ``on_stream_started`` refuses its request: the log said it went on."""
    caplog.set_level(logging.ERROR, logger="nexus.hooks")
    hooks = Hooks()
    hooks.add(SlowStart(), timeout_s=0.05)
    async with Engine([MockProvider("mock")], hooks=hooks) as engine:
        with pytest.raises(GatewayError) as refused:
            await accumulate(engine.complete_stream(chat()))
    assert refused.value.code == "plugin_timeout"
    raising = Hooks()
    raising.add(RaisingStart())
    async with Engine([MockProvider("mock")], hooks=raising) as engine:
        await accumulate(engine.complete_stream(chat()))
    assert [r.getMessage() for r in caplog.records] == [
        "plugin SlowStart did not return within 0.05s (abandoned) in on_stream_started; "
        "the request is refused (503 plugin_timeout)",
        "plugin RaisingStart raised in on_stream_started; the request goes on",
    ]
    assert [bool(r.exc_info) for r in caplog.records] == [False, True]

"""Each hook call is bounded and contained (nexus.hook_calls), from the Python API."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from nexus import Engine, Hooks, MockProvider, accumulate
from nexus.hook_calls import guarded
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

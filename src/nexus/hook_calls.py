"""One plugin hook's call, bounded and contained; how a hook method is called (used by
:mod:`nexus.hooks`).

A hook is someone else's code running inside a stream: the stream's end (its
billing, its metrics, the key's stream slot) waits for it. So each call is
bounded by its plugin's ``timeout_s`` (``[[plugins]] timeout_s``), and what it
raises stays with it: an exception, a timeout, a ``SystemExit`` or
``KeyboardInterrupt`` (a library calling ``sys.exit()``: one plugin must not stop a
gateway serving everyone), or a ``CancelledError`` the hook raised on its own
(awaiting a future some other task cancelled) while the task running it is not
being cancelled. Each is one hook error, logged and counted; the stream goes on. A
cancellation of the task itself still goes through; one that arrives while a stream's
end hooks run (:func:`guarded_each`) interrupts the call under way, then the other
plugins' end hooks still run, each within its bound, before it goes on.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

__all__ = [
    "AFTER_FAILURE",
    "HOOK_TIMEOUT_S",
    "end_call",
    "guarded",
    "guarded_each",
    "is_async",
    "takes_spend",
]

HOOK_TIMEOUT_S = 5.0
"""How long one hook call may take by default (``[[plugins]] timeout_s``); then it is
abandoned and counted as a hook error."""

Failed = Callable[[str, bool], None]
"""Told of a failed call: what went wrong, and whether the call was abandoned at its bound
(else it raised: a traceback is worth logging)."""


async def guarded(
    call: Callable[[], Awaitable[object]],
    timeout_s: float | None,
    failed: Failed,
    passes: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> bool:
    """Await ``call()`` for at most ``timeout_s`` (None: no bound); tell ``failed`` of a
    failure instead of raising it. ``passes``: exceptions raised as they are (a
    :class:`~nexus.hooks.StreamRejected` from ``on_stream_started``). True when the call
    was abandoned at its bound (a gate that could not decide in time: see
    :meth:`~nexus.hooks.Hooks.started`)."""
    bound = None
    task = asyncio.current_task()
    # Cancellations of the task requested before this call (one that arrived during an
    # earlier hook: guarded_each) are not this call's to raise.
    before = 0 if task is None else task.cancelling()
    try:
        if timeout_s is None:
            await call()
            return False
        async with asyncio.timeout(timeout_s) as bound:
            await call()  # called in here: a plain function's error is the hook's too
    except passes:
        raise
    except TimeoutError:
        if bound is not None and bound.expired():
            failed(f"did not return within {timeout_s:g}s (abandoned)", True)
            return True
        failed("raised", False)
    except asyncio.CancelledError:
        if task is None or task.cancelling() > before:
            raise  # the task itself is being cancelled: not the hook's doing
        if bound is not None and bound.expired():  # (a task cancelled before: Python 3.11's
            failed(f"did not return within {timeout_s:g}s (abandoned)", True)  # timeout)
            return True
        failed("raised CancelledError (its task was not cancelled)", False)
    except GeneratorExit:
        raise  # the coroutine is being closed: not the hook's doing
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: see the module docstring
        failed("raised" if isinstance(exc, Exception) else f"raised {type(exc).__name__}", False)
    return False


Call = tuple[Callable[[], Awaitable[object]], float | None, Failed]
"""One hook call for :func:`guarded_each`: the call, its bound, who hears of its failure."""


async def guarded_each(calls: Iterable[Call]) -> None:
    """Each of ``calls`` in order, :func:`guarded` (a stream's end hooks: every plugin gets
    its one). A cancellation of the task that arrives meanwhile interrupts the call under
    way, not the ones after it: it is raised once the last has run."""
    cancelled: asyncio.CancelledError | None = None
    try:
        for call, timeout_s, failed in calls:
            try:
                await guarded(call, timeout_s, failed)
            except asyncio.CancelledError as exc:
                cancelled = exc
        if cancelled is not None:
            raise cancelled
    finally:
        cancelled = None  # (no cycle through the traceback)


def end_call(
    hook: Callable[..., Awaitable[object]], args: tuple[Any, ...], spend: object | None
) -> Callable[[], Awaitable[object]]:
    """The call of an end hook with ``args``, and ``spend=`` when not None (for a method
    that :func:`takes_spend`)."""
    if spend is None:
        return lambda: hook(*args)
    return lambda: hook(*args, spend=spend)


def takes_spend(method: Callable[..., object]) -> bool:
    """Whether a hook method takes ``spend=`` (looked at once, when the plugin is added)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "spend" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def is_async(method: Callable[..., object]) -> bool:
    """Whether calling ``method`` gives a coroutine to await: an ``async def`` (or one
    wrapped by a decorator that says so, or an object with an ``async def __call__``).
    A plain function is refused when added: it would run, then fail at every call."""
    call = type(method).__call__  # (``method`` is callable: checked before)
    return any(inspect.iscoroutinefunction(f) for f in (method, inspect.unwrap(method), call))


AFTER_FAILURE = {
    "on_stream_started": "the request goes on",
    "on_chunk_received": "the stream goes on",
    "on_stream_completed": "the other plugins' hooks still run",
    "on_stream_failed": "the other plugins' hooks still run",
}
"""What a hook error leaves running, for its log line."""

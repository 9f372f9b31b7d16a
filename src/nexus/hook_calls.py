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
cancellation of the task itself still goes through.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

__all__ = ["AFTER_FAILURE", "HOOK_TIMEOUT_S", "guarded", "is_async", "takes_spend"]

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
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # the task itself is being cancelled: not the hook's doing
        failed("raised CancelledError (its task was not cancelled)", False)
    except GeneratorExit:
        raise  # the coroutine is being closed: not the hook's doing
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: see the module docstring
        failed("raised" if isinstance(exc, Exception) else f"raised {type(exc).__name__}", False)
    return False


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

"""Events to compact JSON and back, for stores that keep logs outside the process. Sans-I/O.

A stored log must give back the very events (the clients' NDJSON form drops some), so
each is stored as ``[type, field, ...]`` in dataclass field order (a delta's tool calls
as nested lists). Fields added after logs were first stored (:data:`_ADDED`) are left
off while they hold their default: a replica that does not know them reads a log
written now, and a log stored before them loads with their defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import orjson

from ..events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Heartbeat,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
    content_delta,
    plain_content,
)

__all__ = [
    "dump_entry",
    "dump_event",
    "dumps_events",
    "event_size",
    "load_event",
    "loads_events",
]

_CLASSES: dict[str, type[Any]] = {
    cls.type: cls
    for cls in (Delta, Reasoning, ToolCall, Audio, Image, Citation, Usage, Error, Heartbeat, Done)
}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _CLASSES.values()}
_CALLS = _FIELDS[Delta].index("tool_calls")
_ADDED: dict[type[Any], int] = {
    Usage: 10,
    Delta: 2,
    Reasoning: 1,
    Audio: 2,
    ToolCall: 1,
    Citation: 1,
}
"""Per class, how many of its last fields came after the first stored format (usage's
partial, cost_usd, token details and hour-long cache writes, a delta's stop_sequence and
stop_reason, reasoning's redacted, audio's id and expires_at, a tool call's extra_content,
a citation's source)."""
_TOKEN_TAIL = [None] * (len(_FIELDS[Delta]) - 1 - _ADDED[Delta])  # a token's stored fields
_DEFAULTS = {
    cls: tuple(f.default for f in dataclasses.fields(cls)[len(_FIELDS[cls]) - added :])
    for cls, added in _ADDED.items()
}


def dump_event(event: StreamEvent) -> list[Any]:
    """``[type, *fields]``: JSON-ready, exact. A token (a delta of content only, the
    commonest event) is made without looking its fields up."""
    content = plain_content(event)
    if content is not None:
        delta = cast(Delta, event)
        if delta.stop_sequence is None and delta.stop_reason is None:
            return ["delta", content, *_TOKEN_TAIL]
    return _dump_fields(event)


def _dump_fields(event: StreamEvent) -> list[Any]:
    """:func:`dump_event` of any event, field by field."""
    cls = type(event)
    out: list[Any] = [cls.type]
    for name in _FIELDS[cls]:
        value = getattr(event, name)
        if name == "tool_calls" and value is not None:
            value = [_dump_fields(call)[1:] for call in value]
        out.append(value)
    defaults = _DEFAULTS.get(cls)
    if defaults is not None:
        first = len(out) - len(defaults)  # where the added fields start in ``out``
        while len(out) > first and out[-1] == defaults[len(out) - 1 - first]:
            out.pop()
    return out


def load_event(data: Sequence[Any]) -> StreamEvent:
    """The event :func:`dump_event` gave ``data`` for. Raises ``ValueError`` on bad input."""
    try:
        cls = _CLASSES[data[0]]
        if cls is Delta and data[2:] == _TOKEN_TAIL and type(data[1]) is str:
            return content_delta(data[1])  # a token: shared, as the upstream decoders make it
        values = list(data[1:])
        missing = len(_FIELDS[cls]) - len(values)
        if missing:  # a log stored before the fields added since (or junk)
            added = _DEFAULTS.get(cls, ())
            if not 0 < missing <= len(added):
                raise ValueError(f"a stored {data[0]} event has {len(values)} fields")
            values += added[len(added) - missing :]
        if cls is Delta and values[_CALLS] is not None:
            if not all(type(call) is list for call in values[_CALLS]):
                raise ValueError("stored tool calls are not lists")
            values[_CALLS] = tuple(ToolCall(*call) for call in values[_CALLS])
        event: StreamEvent = cls(*values)
    except (TypeError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"not a stored event: {data!r:.80}") from exc
    return event


def dumps_events(events: Sequence[StreamEvent]) -> bytes:
    return orjson.dumps([dump_event(event) for event in events])


def dump_entry(events: Sequence[StreamEvent]) -> tuple[bytes, int]:
    """:func:`dumps_events` of ``events``, and what they count toward ``[streams]
    max_log_bytes``, in one pass (a shared store's mirror makes an entry of each log it
    writes per turn: mostly one token). The count is :func:`event_size` of each event but
    a terminal (:class:`Done`, :class:`Error`, a log's last entry), as the run that bounds
    the log counts them (:mod:`nexus.cache.run`): one measure for the run and for the copy
    a shared store keeps, so that a log the run let finish is never trimmed there."""
    dumped = []
    size = 0
    for event in events:
        dumped.append(dump_event(event))
        cls = type(event)
        if cls is not Done and cls is not Error:
            size += event_size(event)
    return orjson.dumps(dumped), size


def loads_events(data: bytes | str) -> list[StreamEvent]:
    return [load_event(item) for item in orjson.loads(data)]


def event_size(event: StreamEvent) -> int:
    """About the bytes an event costs in a log: exact enough for bounds, cheap per token.

    Measured with tracemalloc on CPython 3.11: a content delta costs ~130 bytes
    besides its text (the object, the ``str`` header, the log's slot), other
    events somewhat less than their JSON plus ~60, so that ``max_log_bytes``
    and the memory store's bound are bounds on memory, not on text.
    """
    if type(event) is Delta and event.content is not None and event.tool_calls is None:
        return 128 + len(event.content)
    return 64 + len(orjson.dumps(dump_event(event)))

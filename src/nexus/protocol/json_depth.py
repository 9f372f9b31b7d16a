"""How deep a request's JSON may nest and how many values it may hold, and the walk that
checks both. Sans-I/O.

A few kilobytes can nest a thousand levels; orjson parses that, but every later walk
recurses (validation, the cache key, the upstream body, whose encoder fails past 254
levels). And every value costs about 2 µs of the event loop all tenants share, walked,
validated and keyed: 900,000 short messages in 27 MB held it for five seconds. So a
request is refused once, right after parsing, when it nests deeper than ``[limits]
max_json_depth`` or holds more than ``[limits] max_json_items`` values.
"""

from __future__ import annotations

from typing import Any

from ..errors import GatewayError, InvalidRequest, RequestTooLarge

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_JSON_ITEMS",
    "deep_field",
    "deeper_than",
    "more_items_than",
    "shape_error",
    "too_deep",
    "too_many_items",
]

MAX_JSON_DEPTH = 64
"""The default of ``[limits] max_json_depth``."""

MAX_JSON_ITEMS = 100_000
"""The default of ``[limits] max_json_items``: about 0.2 s of the event loop at most."""

_DEEP, _MANY = 1, 2


def _walk(value: Any, max_depth: int, max_items: int) -> int:
    """0, or ``_DEEP`` past ``max_depth`` levels, or ``_MANY`` past ``max_items`` values
    (the members and elements of every object and array). Iterative: no recursion to
    overflow, and it stops at the first limit passed."""
    if not isinstance(value, dict | list):
        return 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    items = 0
    while stack:
        node, depth = pop()
        if depth > max_depth:
            return _DEEP
        items += len(node)
        if items > max_items:
            return _MANY
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                push((child, depth + 1))
    return 0


def deeper_than(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests objects and arrays more than ``limit`` levels deep
    (``{}`` is one level, a scalar none)."""
    return _walk(value, limit, 1 << 62) == _DEEP


def more_items_than(value: Any, limit: int) -> bool:
    """Whether parsed JSON holds more than ``limit`` values in its objects and arrays."""
    return _walk(value, 1 << 62, limit) == _MANY


def deep_field(obj: dict[str, Any], limit: int) -> str | None:
    """The first field of ``obj`` whose value makes ``obj`` nest more than ``limit``
    levels deep, or None: which part of a request to name in the error."""
    if not deeper_than(obj, limit):  # one walk for the whole object (the common case)
        return None
    for name, value in obj.items():
        if deeper_than(value, limit - 1):
            return name
    return None


def shape_error(obj: dict[str, Any], max_depth: int, max_items: int) -> GatewayError | None:
    """What is wrong with the shape of a request, in one walk (the common case): nested
    too deep (naming the field) or too many values; None when neither."""
    found = _walk(obj, max_depth, max_items)
    if found == _MANY:
        return too_many_items(max_items)
    if found == _DEEP:
        return too_deep(deep_field(obj, max_depth) or "", max_depth)
    return None


def too_many_items(limit: int) -> RequestTooLarge:
    """413 ``request_too_large``: more values than ``[limits] max_json_items``."""
    return RequestTooLarge(
        f"The request holds more than the limit of {limit} JSON values in its objects and "
        "arrays ([limits] max_json_items)."
    )


def too_deep(param: str, limit: int) -> InvalidRequest:
    """400 ``invalid_request`` naming the field that nests too deep."""
    return InvalidRequest(
        f"{param}: nested deeper than the limit of {limit} levels of JSON objects and "
        "arrays (counted from the request body)",
        param=param,
    )

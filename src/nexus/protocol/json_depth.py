"""How deep a request's JSON may nest, and the walk that checks it. Sans-I/O.

A few kilobytes can nest a thousand levels; orjson parses that, but every later walk
recurses (validation, the cache key, the upstream body, whose encoder fails past 254
levels). So a request is refused once, right after parsing, when it nests deeper than
``[limits] max_json_depth``.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest

__all__ = ["MAX_JSON_DEPTH", "deep_field", "deeper_than", "too_deep"]

MAX_JSON_DEPTH = 64
"""The default of ``[limits] max_json_depth``."""


def deeper_than(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests objects and arrays more than ``limit`` levels deep
    (``{}`` is one level, a scalar none). Iterative: no recursion to overflow."""

    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                push((child, depth + 1))
    return False


def deep_field(obj: dict[str, Any], limit: int) -> str | None:
    """The first field of ``obj`` whose value makes ``obj`` nest more than ``limit``
    levels deep, or None: which part of a request to name in the error."""
    if not deeper_than(obj, limit):  # one walk for the whole object (the common case)
        return None
    for name, value in obj.items():
        if deeper_than(value, limit - 1):
            return name
    return None


def too_deep(param: str, limit: int) -> InvalidRequest:
    """400 ``invalid_request`` naming the field that nests too deep."""
    return InvalidRequest(
        f"{param}: nested deeper than the limit of {limit} levels of JSON objects and "
        "arrays (counted from the request body)",
        param=param,
    )

"""How deep a request's JSON may nest, and the walk that checks it. Sans-I/O.

A body of a few kilobytes can nest arrays a thousand levels deep. Parsing it is cheap
(orjson stops at 1024 levels), but every later step that walks the request again
recurses: validation, the cache key, the body sent upstream (orjson's encoder stops at
254 levels, with an error that would surface as a 500). So a request is refused at the
edge, once, right after it is parsed, when it nests deeper than ``[limits]
max_json_depth`` (64 by default: a chat request with tool schemas needs a dozen or two).
A body past orjson's own limit is not JSON it can parse: ``invalid_json``, also a 400.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest

__all__ = ["MAX_JSON_DEPTH", "deep_field", "deeper_than", "too_deep"]

MAX_JSON_DEPTH = 64
"""The default of ``[limits] max_json_depth``."""


def deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON: dicts, lists, scalars) nests objects and arrays
    more than ``limit`` levels deep. ``{}`` and ``[]`` are one level, a scalar none.

    Iterative (no recursion to overflow), each container looked at once, and it
    stops at the first one past the limit.
    """
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

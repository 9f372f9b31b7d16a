"""How deep a request's JSON may nest, and the walk that checks it. Sans-I/O.

A body of a few kilobytes can nest arrays a thousand levels deep. Parsing it is cheap
(orjson stops at 1024 levels), but every later step that walks the request again
recurses: validation, the cache key, the body sent upstream (orjson's encoder stops at
254 levels, with an error that would surface as a 500). So a request is refused at the
edge, once, right after it is parsed, when it nests deeper than ``[limits]
max_json_depth`` (64 by default: a chat request with tool schemas needs a dozen or two).
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest

__all__ = ["MAX_JSON_DEPTH", "deeper_than", "too_deep"]

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


def too_deep(limit: int, what: str = "The request body") -> InvalidRequest:
    return InvalidRequest(f"{what} nests JSON objects and arrays deeper than {limit} levels.")

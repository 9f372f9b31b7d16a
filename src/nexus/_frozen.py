"""A faster ``__init__`` for frozen, slotted dataclasses: the stream events.

A frozen dataclass's generated ``__init__`` assigns each field through
``object.__setattr__`` (to get past its own ``__setattr__``, which refuses):
about four times the cost of a plain assignment, paid for every event of every
stream. The slot descriptors' ``__set__`` gets past it as well, at the cost of
a plain assignment. Same signature, same defaults, same result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["quick_init"]

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Replace ``cls.__init__`` (a frozen, slotted dataclass with plain defaults)."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    namespace: dict[str, Any] = {}
    params: list[str] = []
    body: list[str] = []
    for field in fields:
        if field.default_factory is not dataclasses.MISSING or not field.init:
            raise TypeError(f"quick_init: {cls.__name__}.{field.name} needs the generated init")
        namespace[f"_set_{field.name}"] = cls.__dict__[field.name].__set__
        if field.default is dataclasses.MISSING:
            params.append(field.name)
        else:
            namespace[f"_default_{field.name}"] = field.default
            params.append(f"{field.name}=_default_{field.name}")
        body.append(f"    _set_{field.name}(self, {field.name})")
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body or ["    pass"])
    exec(source, namespace)  # built from the class's own field names
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    setattr(cls, "__init__", init)  # noqa: B010 - mypy refuses assigning a method
    return cls

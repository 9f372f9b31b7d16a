"""A faster ``__init__`` for frozen, slotted dataclasses: the stream events.

A frozen dataclass's generated ``__init__`` assigns each field through
``object.__setattr__`` (to get past its own ``__setattr__``, which refuses):
about four times the cost of a plain assignment, paid for every event of every
stream. The slot descriptors' ``__set__`` gets past it as well, at the cost of
a plain assignment. Same signature, same defaults, same result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["quick_init", "quick_new"]

T = TypeVar("T")


def _init(cls: type, namespace: dict[str, Any], assign: str, last: str = "") -> Any:
    """An ``__init__`` with ``cls``'s fields and defaults, each field stored by ``assign``
    (a format of ``name``), then ``last``; compiled in ``namespace``."""
    params: list[str] = []
    body: list[str] = []
    for field in dataclasses.fields(cls):
        if field.default_factory is not dataclasses.MISSING or not field.init:
            raise TypeError(f"{cls.__name__}.{field.name} needs the generated init")
        if field.default is dataclasses.MISSING:
            params.append(field.name)
        else:
            namespace[f"_default_{field.name}"] = field.default
            params.append(f"{field.name}=_default_{field.name}")
        body.append("    " + assign.format(name=field.name))
    if last:
        body.append("    " + last)
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body or ["    pass"])
    exec(source, namespace)  # built from the class's own field names
    return namespace["__init__"]


def quick_init(cls: type[T]) -> type[T]:
    """Replace ``cls.__init__`` (a frozen, slotted dataclass with plain defaults)."""
    namespace: dict[str, Any] = {
        f"_set_{field.name}": cls.__dict__[field.name].__set__
        for field in dataclasses.fields(cls)  # type: ignore[arg-type]
    }
    init = _init(cls, namespace, "_set_{name}(self, {name})")
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    setattr(cls, "__init__", init)  # noqa: B010 - mypy refuses assigning a method
    return cls


def quick_new(cls: type[T]) -> Callable[..., T]:
    """A constructor for ``cls`` (a :func:`quick_init` class) at about half its cost.

    The slot descriptors' ``__set__`` is still a call per field; a plain slotted twin
    of the class assigns its fields with plain stores, then the instance becomes a
    ``cls`` (same slots, same layout: CPython allows the ``__class__`` change). For
    the hottest construction of all, the content delta of every token.
    """
    init = _init(cls, {"_cls": cls}, "self.{name} = {name}", "self.__class__ = _cls")
    slots = cls.__dict__["__slots__"]
    return type(f"_New{cls.__name__}", (), {"__slots__": slots, "__init__": init})

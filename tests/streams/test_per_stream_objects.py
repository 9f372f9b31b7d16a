"""What an idle stream holds: its biggest objects keep no instance dict.

CPython 3.11 shares one key table among the instances of a class while they have fewer
than 30 attributes; past that, each instance gets a dict of its own, ~1.6 KB where slots
take ~0.3. A stream's run and its pump have more (``bench/README.md``, idle memory), so
they declare ``__slots__`` down their whole class chain: one attribute added to them, or a
base without slots, would give every open stream its dict back."""

from __future__ import annotations

import tracemalloc

import pytest

from nexus.cache.run import StreamRun
from nexus.server.streaming import StreamPump

SHARED_KEYS_MAX = 30  # CPython's SHARED_KEYS_MAX_SIZE


@pytest.mark.parametrize("cls", [StreamRun, StreamPump], ids=lambda c: c.__name__)
def test_a_stream_s_run_and_pump_have_no_instance_dict(cls: type) -> None:
    without = [base.__name__ for base in cls.__mro__[:-1] if "__slots__" not in vars(base)]
    assert not without, f"{cls.__name__}: no __slots__ in {without}: each instance has a dict"
    assert "__dict__" not in dir(cls)


def test_the_slots_are_worth_it_on_this_interpreter() -> None:
    """The reason above, measured: with as many attributes as a run has, an instance
    without slots costs over 1 KB more than one with them (so dropping them is a
    regression, not a tidy-up)."""
    names = tuple(n for base in StreamRun.__mro__[:-1] for n in vars(base).get("__slots__", ()))
    assert len(names) >= SHARED_KEYS_MAX

    def init(self: object) -> None:
        for name in names:
            setattr(self, name, None)

    plain = type("Plain", (), {"__init__": init})
    slotted = type("Slotted", (), {"__init__": init, "__slots__": names})
    assert bytes_each(plain) - bytes_each(slotted) > 1000


def bytes_each(cls: type, count: int = 200) -> float:
    cls(), cls()  # (the class's own caches, made by its first instances)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [cls() for _ in range(count)]
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del kept
    return (after - before) / count

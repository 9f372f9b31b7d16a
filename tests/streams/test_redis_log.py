"""The Redis log's pure parts: entries to events (overlaps cut, holes refused) and the
packing of pipelined commands (held to redis-py's own)."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from nexus.cache.codec import dumps_events
from nexus.cache.redis_log import APPEND, Appends, decode
from nexus.cache.redis_pipeline import _pack, bulk
from nexus.errors import StreamIncomplete
from nexus.events import Delta, Done, StreamEvent

EVENTS: list[StreamEvent] = [Delta(content=f"t{i}") for i in range(8)] + [Done()]


def entry(first: int, end: int, raw: bool = False) -> tuple[bytes, Any]:
    """The entry of events ``first`` to ``end`` (exclusive), as XRANGE gives it (raw: a
    reply not parsed by redis-py, its fields a flat list)."""
    payload = dumps_events(EVENTS[first:end])
    return f"0-{end}".encode(), [b"e", payload] if raw else {b"e": payload}


@pytest.mark.parametrize("raw", [False, True])
def test_decode_reads_on_from_an_index_inside_an_entry(raw: bool) -> None:
    entries = [entry(0, 3, raw), entry(3, 5, raw)]
    assert decode("s", entries, 1) == (EVENTS[2:5], 4, False)


def test_decode_cuts_an_overlapping_entry_and_stops_at_the_terminal() -> None:
    # A retried append carried entries 2..5 again, with more: each event once.
    entries = [entry(0, 4), entry(2, 6), entry(6, 9)]
    assert decode("s", entries, -1) == (EVENTS, 8, True)


def test_decode_skips_an_entry_read_already() -> None:
    assert decode("s", [entry(0, 2), entry(2, 4)], 2) == (EVENTS[3:4], 3, False)


def test_decode_refuses_a_hole() -> None:
    with pytest.raises(StreamIncomplete, match="missing entries from 3"):
        decode("s", [entry(0, 3), entry(4, 6)], -1)
    with pytest.raises(StreamIncomplete, match="missing entries from 0"):
        decode("s", [entry(2, 4)], -1)  # trimmed: the start is gone


args = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20),
    st.integers(min_value=-(2**40), max_value=2**40),
)


names = st.sampled_from(["XADD", "SET", "EVAL", "CLIENT"])


@given(st.lists(st.tuples(names, st.lists(args, max_size=6)), min_size=1, max_size=5))
def test_pack_is_what_redis_py_sends(pairs: list[tuple[str, list[Any]]]) -> None:
    commands = [[name, *rest] for name, rest in pairs]
    connection = aioredis.Connection()
    expected = b"".join(connection.pack_commands([tuple(c) for c in commands]))
    assert _pack([tuple(c) for c in commands]) == expected


def test_the_declared_redis_floor_has_get_connection_without_arguments() -> None:
    """The Pipeliner takes its connection with ``pool.get_connection()``, no command name:
    redis-py made the argument optional in 5.3 (before, it is required: every store
    command would fail with a TypeError). The dependency must not allow an older one."""
    import re
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"redis\b", d)]
    floor = re.search(r">=\s*([0-9.]+)", spec)
    assert floor is not None, spec
    assert tuple(int(p) for p in floor.group(1).split(".")) >= (5, 3), spec


entries = st.lists(
    st.tuples(
        st.binary(min_size=1, max_size=30),  # the log's key
        st.integers(min_value=1, max_value=2**40),  # the entry's end
        st.binary(max_size=60),  # its payload
        st.booleans(),  # NOMKSTREAM
        st.integers(min_value=0, max_value=2**40),  # trim below (0: none)
    ),
    min_size=1,
    max_size=8,
)


@given(entries)
def test_appends_are_the_append_script_as_redis_py_packs_it(
    added: list[tuple[bytes, int, bytes, bool, int]],
) -> None:
    # The mirror writes its turn's EVAL in RESP as it goes: the very bytes of the command
    # built argument by argument.
    appends = Appends()
    keys: list[bytes] = []
    args: list[Any] = []
    for log, end, payload, exists, trim in added:
        appends.add(bulk(log), end, payload, exists=exists, trim=trim)
        head = (["NOMKSTREAM"] if exists else []) + (["MINID", "~", f"0-{trim}"] if trim else [])
        keys.append(log)
        args += [len(head) + 3, *head, f"0-{end}", "e", payload]
    command = ("EVAL", APPEND, len(keys), *keys, *args)
    expected = b"".join(aioredis.Connection().pack_commands([command]))
    assert len(appends) == len(added)
    assert appends.command() == expected
    assert _pack([("PING",), appends.command(), ("PING",)]) == _pack([("PING",)]) + expected + (
        _pack([("PING",)])
    )

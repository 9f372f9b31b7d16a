"""The request path's shortcuts give what the general path gives: a body read at once
when it is all in, an ``Accept`` ranked once, a metric's children looked up once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from unittest import mock

from aiohttp import StreamReader, web
from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.config import Config
from nexus.protocol.negotiation import _best_accepted, parse_accept, select_format
from nexus.server.metrics import Metrics
from nexus.server.routes.common import read_body
from nexus.server.state import CONFIG

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
NATIVE = "application/vnd.nexus.events+sse"


def _request(payload: StreamReader) -> web.Request:
    app = web.Application()
    app[CONFIG] = Config()
    return make_mocked_request("POST", "/v1/chat/completions", app=app, payload=payload)


def _reader() -> StreamReader:
    protocol = mock.Mock(_reading_paused=False)
    return StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=64), max_size=5))
def test_a_body_all_in_reads_as_one_that_arrives_in_pieces(pieces: list[bytes]) -> None:
    async def both() -> tuple[bytes, bytes]:
        whole = _reader()  # every piece and the end in before the route reads: no wait
        for piece in pieces:
            whole.feed_data(piece)
        whole.feed_eof()
        at_once = await read_body(_request(whole))

        trickled = _reader()  # the general path: the route waits for each piece

        async def feed() -> None:
            for piece in pieces:
                await asyncio.sleep(0)
                trickled.feed_data(piece)
            await asyncio.sleep(0)
            trickled.feed_eof()

        feeding = asyncio.ensure_future(feed())
        in_pieces = await read_body(_request(trickled))
        await feeding
        return at_once, in_pieces

    at_once, in_pieces = asyncio.run(both())
    assert at_once == in_pieces == b"".join(pieces)


class _Table:
    """A registry as negotiation sees it."""

    def __init__(self, media_types: Sequence[str]) -> None:
        self.types = list(media_types)

    def resolve(self, name: str) -> str | None:
        return name if name in self.types else None

    def media_types(self) -> Sequence[str]:
        return list(self.types)

    def describe(self) -> str:
        return ", ".join(self.types)

    def content_type(self, media_type: str) -> str:
        return media_type


_RANGES = st.sampled_from(
    [SSE, NDJSON, NATIVE, "*/*", "text/*", "application/*", "application/json", "nonsense"]
)
_ACCEPT = st.lists(
    st.tuples(_RANGES, st.sampled_from(["", ";q=0", ";q=0.5", ";q=1", ";q=x"])), max_size=4
).map(lambda items: ", ".join(r + q for r, q in items))


@settings(max_examples=200, deadline=None)
@given(
    _ACCEPT,
    st.sampled_from([SSE, NDJSON]),
    st.lists(st.sampled_from([SSE, NDJSON, NATIVE]), min_size=1, unique=True),
)
def test_a_cached_accept_ranks_as_it_is_parsed(accept: str, default: str, types: list[str]) -> None:
    table = _Table(types)
    ranked = _best_accepted(parse_accept(accept), default, types) if accept else None
    expected = default if ranked is None else ranked
    for _ in range(2):  # the second answer comes from the cache
        assert select_format(None, None, accept, default, table) == expected


def test_a_cached_accept_is_per_set_of_formats() -> None:
    assert select_format(None, None, NDJSON, SSE, _Table([SSE])) == SSE
    assert select_format(None, None, NDJSON, SSE, _Table([SSE, NDJSON])) == NDJSON


def test_a_cached_child_is_prometheus_own_and_counts() -> None:
    metrics = Metrics()
    child = metrics.requests.labels("/v1/chat/completions", "m", "ok")
    assert child is metrics.requests.labels("/v1/chat/completions", "m", "ok")
    assert child is metrics.requests.labels(
        endpoint="/v1/chat/completions", model="m", outcome="ok"
    )
    child.inc()
    metrics.ttfb.labels("/v1/chat/completions", SSE).observe(0.02)
    assert metrics.ttfb.labels("/v1/chat/completions", SSE) is metrics.ttfb.labels(
        endpoint="/v1/chat/completions", format=SSE
    )
    page = metrics.render().decode()
    assert (
        'nexus_requests_total{endpoint="/v1/chat/completions",model="m",outcome="ok"} 1.0' in page
    )
    assert 'nexus_time_to_first_byte_seconds_count{endpoint="/v1/chat/completions"' in page


def test_a_long_accept_is_ranked_uncached_and_alike() -> None:
    accept = ", ".join(["application/json;q=0.1"] * 20 + [f"{NDJSON};q=0.9"])
    assert len(accept) > 256
    table = _Table([SSE, NDJSON])
    assert _best_accepted(parse_accept(accept), SSE, [SSE, NDJSON]) == NDJSON
    assert select_format(None, None, accept, SSE, table) == NDJSON

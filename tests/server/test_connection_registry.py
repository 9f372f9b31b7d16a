"""ConnectionRegistry: phases, deadlines in order, the cap; sans-I/O with fake connections."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from nexus.config import parse_config
from nexus.errors import ConfigError
from nexus.server.connection_registry import ConnectionRegistry, Phase


@dataclass(eq=False)
class Fake:
    phase: Phase = Phase.CLOSED
    expired: list[str] = field(default_factory=list)
    buffered: int = 0
    timed_elsewhere: bool = False
    hung_up: bool = False

    def expire(self, reason: str) -> None:
        self.expired.append(reason)

    def hang_up(self) -> None:
        self.hung_up = True

    def write_buffer_size(self) -> int:
        return self.buffered


def registry(max_connections: int = 10) -> ConnectionRegistry:
    return ConnectionRegistry(
        header_timeout_s=1.0,
        keepalive_timeout_s=5.0,
        max_connections=max_connections,
        write_timeout_s=30.0,
    )


def test_a_request_head_has_header_timeout_s() -> None:
    reg, conn = registry(), Fake()
    assert reg.admit(conn, 100.0)
    assert conn.phase is Phase.HEAD
    reg.check(100.9)
    assert conn.expired == []
    reg.check(101.0)
    assert conn.expired == ["no complete request head within 1s"]
    assert conn.phase is Phase.CLOSED and reg.open == 0
    reg.lost(conn)  # its connection_lost later: counted once
    assert reg.open == 0


def test_a_client_that_reads_nothing_is_closed_after_three_times_write_timeout_s() -> None:
    reg, conn = registry(), Fake(buffered=70_000)
    reg.admit(conn, 0.0)
    reg.request_started(conn)
    reg.write_paused(conn, 10.0)
    conn.buffered = 60_000  # some bytes left the buffer: slow, alive
    reg.check(50.0)
    conn.buffered = 90_000  # more queued behind them: no progress
    reg.check(100.0)
    reg.check(139.9)
    assert conn.expired == []
    reg.check(140.0)  # nothing left it for 90 s
    assert conn.expired == ["the client read nothing for 90s"]
    assert conn.phase is Phase.CLOSED and reg.open == 0 and not reg.paused
    reg.lost(conn)
    assert reg.open == 0


def test_a_connection_whose_writer_times_its_writes_is_left_to_it() -> None:
    """A stream pump drops a stalled client itself (write_timeout_s, its accounting):
    the registry's net starts only once the pump lets go."""
    reg, conn = registry(), Fake(buffered=70_000, timed_elsewhere=True)
    reg.admit(conn, 0.0)
    reg.request_started(conn)
    reg.write_paused(conn, 0.0)
    reg.check(1000.0)
    assert conn.expired == []
    conn.timed_elsewhere = False  # the pump is done; the client still reads nothing
    reg.check(1089.9)
    assert conn.expired == []
    reg.check(1090.0)
    assert conn.expired == ["the client read nothing for 90s"]


def test_a_paused_connection_past_two_deadlines_is_counted_once() -> None:
    reg, conn = registry(), Fake()
    reg.admit(conn, 0.0)
    reg.write_paused(conn, 0.0)  # still in its head's phase
    reg.check(100.0)
    assert conn.expired == ["no complete request head within 1s"]
    assert reg.open == 0 and not reg.paused


def test_a_write_that_resumes_or_an_upgrade_is_not_timed() -> None:
    reg, conn, ws = registry(), Fake(), Fake()
    for c in (conn, ws):
        reg.admit(c, 0.0)
        reg.request_started(c)
        reg.write_paused(c, 0.0)
    reg.write_resumed(conn)
    reg.upgraded(ws)  # its socket has a stall check of its own
    reg.write_paused(ws, 0.0)
    reg.check(1e6)
    assert conn.expired == [] and ws.expired == []


def test_a_running_request_is_not_timed() -> None:
    reg, conn = registry(), Fake()
    reg.admit(conn, 0.0)
    reg.request_started(conn)
    assert conn.phase is Phase.BUSY
    reg.check(1e6)
    assert conn.expired == []


def test_idle_after_a_response_then_a_next_head() -> None:
    reg, conn = registry(), Fake()
    reg.admit(conn, 0.0)
    reg.request_started(conn)
    reg.response_done(conn, 10.0)
    assert conn.phase is Phase.IDLE
    reg.check(14.9)
    assert conn.expired == []
    reg.head_begun(conn, 14.0)  # first byte of the next request: the head timeout again
    reg.check(14.9)
    assert conn.expired == []
    reg.check(15.0)
    assert conn.expired == ["no complete request head within 1s"]


def test_an_idle_connection_expires_after_keepalive_timeout_s() -> None:
    reg, conn = registry(), Fake()
    reg.admit(conn, 0.0)
    reg.request_started(conn)
    reg.response_done(conn, 10.0)
    reg.check(15.0)
    assert conn.expired == ["idle for 5s"]


def test_a_pipelined_request_starts_from_idle() -> None:
    reg, conn = registry(), Fake()
    reg.admit(conn, 0.0)
    reg.request_started(conn)
    reg.response_done(conn, 1.0)
    reg.request_started(conn)
    assert conn.phase is Phase.BUSY
    reg.check(1e6)
    assert conn.expired == []


def test_an_upgraded_connection_is_not_timed() -> None:
    reg, conn = registry(), Fake()
    reg.admit(conn, 0.0)
    reg.request_started(conn)
    reg.upgraded(conn)
    reg.response_done(conn, 1.0)  # the 101's handler ends when the WebSocket does
    reg.check(1e6)
    assert conn.expired == [] and conn.phase is Phase.UPGRADED


def test_deadlines_stay_in_order_as_connections_move() -> None:
    reg = registry()
    conns = [Fake() for _ in range(4)]
    for i, conn in enumerate(conns):
        reg.admit(conn, float(i))
    reg.request_started(conns[0])
    reg.response_done(conns[0], 0.5)
    reg.head_begun(conns[0], 3.5)  # now the latest head deadline (4.5)
    reg.check(3.2)  # 1.0, 2.0 and 3.0 are past; 4.0 and 4.5 are not
    assert [bool(c.expired) for c in conns] == [False, True, True, False]
    reg.check(4.5)
    assert all(c.expired for c in conns)
    assert reg.open == 0


def test_the_cap() -> None:
    reg = registry(max_connections=2)
    refused: list[None] = []
    reg.on_refused.append(lambda: refused.append(None))  # what /metrics counts
    a, b, c = Fake(), Fake(), Fake()
    assert reg.admit(a, 0.0) and reg.admit(b, 0.0)
    assert refused == []
    assert not reg.admit(c, 0.0)
    assert c.phase is Phase.REJECTED and reg.open == 2
    assert not reg.admit(Fake(), 0.0)
    assert len(refused) == 2
    reg.lost(c)  # a rejected connection was never counted
    assert reg.open == 2
    reg.lost(a)
    assert reg.open == 1
    assert reg.admit(Fake(), 0.0)


def test_rejected_connections_linger_briefly_and_are_bounded() -> None:
    closed: list[int] = []

    class Transport:
        def __init__(self, n: int) -> None:
            self.n = n

        def close(self) -> None:
            closed.append(self.n)

    reg = registry(max_connections=1)
    reg.admit(Fake(), 0.0)
    first, second = Fake(), Fake()
    assert not reg.admit(first, 0.0)
    assert reg.linger(first, Transport(1), 0.0)  # type: ignore[arg-type]
    assert not reg.admit(second, 0.0)
    assert not reg.linger(second, Transport(2), 0.0)  # type: ignore[arg-type]
    reg.check(0.9)
    assert closed == []
    reg.check(1.0)
    assert closed == [1] and not reg.lingering


def test_the_rejection_is_a_complete_503() -> None:
    rejection = registry(max_connections=7).rejection("req_0123abcd")
    head, _, body = rejection.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"\r\nRetry-After: 1" in head and b"\r\nConnection: close" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert b'"code":"too_many_connections"' in body and b"7 connections" in body
    # Its request id, as every response's: in both headers and in the error body.
    assert b"\r\nX-Request-Id: req_0123abcd\r\n" in head
    assert b"\r\nrequest-id: req_0123abcd\r\n" in head
    assert b'"request_id":"req_0123abcd"' in body


def test_the_config_keys() -> None:
    server = parse_config({}).server
    assert (server.header_timeout_s, server.keepalive_timeout_s, server.max_connections) == (
        10.0,
        75.0,
        20_000,
    )
    custom = parse_config(
        {"server": {"header_timeout_s": 0.5, "keepalive_timeout_s": 2, "max_connections": 3}}
    ).server
    assert (custom.header_timeout_s, custom.keepalive_timeout_s, custom.max_connections) == (
        0.5,
        2.0,
        3,
    )
    for bad in ({"header_timeout_s": 0}, {"keepalive_timeout_s": -1}, {"max_connections": 0}):
        with pytest.raises(ConfigError):
            parse_config({"server": bad})


def test_when_the_server_stops_idle_connections_close_now_and_busy_ones_once_answered() -> None:
    reg = registry()
    idle, busy, head = Fake(), Fake(), Fake()
    for conn in (idle, busy, head):
        reg.admit(conn, 0.0)
    for conn in (idle, busy):
        reg.request_started(conn)
    reg.response_done(idle, 0.1)
    reg.close_idle()
    assert (idle.hung_up, busy.hung_up, head.hung_up) == (True, False, False)
    assert idle.phase is Phase.CLOSED and reg.open == 2
    reg.response_done(busy, 0.2)  # answered: closed, not kept alive
    assert busy.hung_up and busy.phase is Phase.CLOSED and reg.open == 1
    assert idle.expired == busy.expired == []  # closed after what was written, not cut


def test_refusals_at_the_cap_are_warned_of_in_counts_every_10_s_at_most(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No line a refused connection (a client could write them at connect speed), and no
    refusal left out: those after a warning are counted in the next one, at a refusal or at
    the tick, 10 s on."""
    reg = registry(max_connections=0)
    caplog.set_level("WARNING", logger="nexus.server")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "max_connections" in r.getMessage()]

    assert not reg.admit(Fake(), 0.0)
    for i in range(50):
        assert not reg.admit(Fake(), 1.0 + i * 0.1)  # a flood that stops within 10 s
    reg.check(9.0)
    assert len(warnings()) == 1 and "1 new connections" in warnings()[0]
    reg.check(10.5)
    assert len(warnings()) == 2 and "50 new connections" in warnings()[1]
    reg.check(30.0)  # nothing refused since: nothing to say
    assert len(warnings()) == 2

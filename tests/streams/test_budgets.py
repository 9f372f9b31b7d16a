"""Budgets: windows (UTC day, month, total), the refusal before a request opens, in every
endpoint's shape, spend kept per window, and ``nexus keys``."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import websockets

from nexus.auth import ApiKey, hash_key
from nexus.budgets import budget_message, key_table, window
from nexus.cache.limits import BudgetExceeded, BudgetPlugin, LocalLimits
from nexus.events import Error
from nexus.hooks import CallContext
from nexus.pricing import Spend
from nexus.server.state import HUB
from nexus.types import Completion
from redis_support import connect_or_skip, drop_keys, new_prefix
from support import MakeClient

KEY = "nx-budget-0123456789-secret"
NEXUS = str(Path(sys.executable).parent / "nexus")


def at(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


@pytest.mark.parametrize(
    ("period", "now", "id", "resets"),
    [
        ("day", "2026-11-25T17:00:00", "2026-11-25", "2026-11-26T00:00:00Z"),
        ("day", "2026-12-31T23:59:59", "2026-12-31", "2027-01-01T00:00:00Z"),
        ("month", "2026-11-25T17:00:00", "2026-11", "2026-12-01T00:00:00Z"),
        ("month", "2026-12-01T00:00:00", "2026-12", "2027-01-01T00:00:00Z"),
        ("month", "2028-02-29T12:00:00", "2028-02", "2028-03-01T00:00:00Z"),
        ("total", "2026-11-25T17:00:00", "total", None),
    ],
)
def test_windows_are_utc_calendar_periods(
    period: str, now: str, id: str, resets: str | None
) -> None:
    win = window(period, at(now))
    assert (win.id, win.resets_iso()) == (id, resets)


def test_a_window_says_when_it_resets_and_outlives_its_end_in_the_store() -> None:
    now = at("2026-11-25T23:59:30")
    day = window("day", now)
    assert day.retry_after_s(now) == 30
    assert day.ttl_s(now) == 30 + 86_400
    assert window("total", now).retry_after_s(now) is None
    assert window("total", now).ttl_s(now) is None
    message = budget_message("alpha", 5, "day", 5.25, day)
    assert "'alpha'" in message and "daily budget of $5" in message
    assert "resets at 2026-11-26T00:00:00Z" in message
    with pytest.raises(ValueError, match="week"):
        window("week", now)


def test_key_table_pads_its_columns() -> None:
    text = key_table([{"name": "alpha", "models": "*", "spent_usd": "0.5"}])
    header, line = text.splitlines()
    assert header.split() == ["name", "models", "budget_usd", "period", "spent_usd", "resets_at"]
    assert line.split() == ["alpha", "*", "-", "-", "0.5", "-"]
    assert header.index("spent_usd") == line.index("0.5")


def spend(cost_usd: float | None, estimated: bool = False) -> Spend:
    return Spend(10, 5, 0, 0, cost_usd, estimated)


async def test_spend_reaching_the_budget_refuses_the_next_request_until_the_window_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [at("2026-11-25T23:59:00")]
    monkeypatch.setattr("nexus.cache.limits.time.time", lambda: clock[0])
    limits = LocalLimits(0, None)
    key = ApiKey("alpha", budget_usd=1.0, budget_period="day")
    plugin = BudgetPlugin(limits, [key, ApiKey("beta")])
    ctx = CallContext(key="alpha")
    final = Completion(id="id", model="m", created=0)
    failed = Error(error_type="server_error", message="gone", code="stream_cancelled")
    await plugin.on_stream_completed(ctx, "id", "m", "p", 0.1, final, spend=spend(0.6))
    await limits.admit(key, stream=True)  # 0.6 of 1.0: still under
    await plugin.on_stream_failed(
        ctx, "id", "m", failed, spend=spend(0.5, True)
    )  # a failed one bills
    await plugin.on_stream_completed(ctx, "id", "m", "p", 0.1, final, spend=spend(None))
    assert await limits.spent(key) == pytest.approx(1.1)
    with pytest.raises(BudgetExceeded) as refused:
        await limits.admit(key, stream=True)
    assert refused.value.status == 429 and refused.value.code == "budget_exceeded"
    assert refused.value.headers == {"Retry-After": "60"}
    assert "resets at 2026-11-26T00:00:00Z" in refused.value.message
    await limits.admit(key, stream=False)  # reading a stream, listing models: no cost
    clock[0] = at("2026-11-26T00:00:01")  # a new day, a new window
    assert await limits.spent(key) == 0.0
    await limits.admit(key, stream=True)


def keyed(budget: float, period: str = "month", **extra: Any) -> dict[str, Any]:
    entry = {"name": "alpha", "sha256": hash_key(KEY), "budget_usd": budget}
    entry["budget_period"] = period
    # A key with a budget runs only models with a price.
    price = {"input_usd_per_mtok": 0, "output_usd_per_mtok": 0}
    return {"auth": {"keys": [entry]}, "models": {"mock/echo": price}, **extra}


BEARER = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_spent_budget_is_a_429_in_each_endpoints_shape(make_client: MakeClient) -> None:
    client = await make_client(keyed(0.5, "day"))
    resp = await client.post("/v1/chat/completions", json=CHAT, headers=BEARER)
    assert resp.status == 200
    hub = client.app[HUB]
    await hub.limits.charge(ApiKey("alpha", budget_usd=0.5, budget_period="day"), 0.5)
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/responses", {"model": "mock/echo", "input": "hi"}),
    ):
        resp = await client.post(path, json=body, headers=BEARER)
        assert resp.status == 429, path
        error = (await resp.json())["error"]
        assert error["code"] == "budget_exceeded"
        assert "daily budget of $0.5" in error["message"] and "resets at" in error["message"]
        assert 1 <= int(resp.headers["Retry-After"]) <= 86_400
    resp = await client.post(
        "/v1/messages", json={**CHAT, "max_tokens": 16}, headers={"x-api-key": KEY}
    )
    assert resp.status == 429
    body = await resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "budget" in body["error"]["message"]
    # Listing models costs nothing: not refused.
    assert (await client.get("/v1/models", headers=BEARER)).status == 200
    # On a socket: an error frame, with the wait, and the socket stays open.
    url = str(client.make_url("/v1/realtime")).replace("http", "ws", 1)
    async with websockets.connect(url, additional_headers=BEARER) as ws:
        await ws.send(orjson.dumps({"type": "start", "request": CHAT}).decode())
        frame = orjson.loads(await ws.recv())
        assert frame["type"] == "error"
        assert frame["error"]["code"] == "budget_exceeded"
        assert frame["error"]["retry_after_s"] >= 1


async def test_a_total_budget_never_resets(make_client: MakeClient) -> None:
    client = await make_client(keyed(0.0, "total"))
    resp = await client.post("/v1/chat/completions", json=CHAT, headers=BEARER)
    assert resp.status == 429
    assert "Retry-After" not in resp.headers
    assert "does not reset" in (await resp.json())["error"]["message"]


async def test_nexus_keys_prints_each_keys_spend_from_redis(tmp_path: Path) -> None:
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    client = await connect_or_skip()
    prefix = new_prefix()
    try:
        store = RedisStore(prefix=prefix, client=client)
        limits = RedisLimits(store, rate=0, per_key=None, lease_s=1, fallback=LocalLimits(0, None))
        alpha = ApiKey("alpha", ("mock/*",), 5.0, "day")
        await limits.charge(alpha, 0.25)
        await limits.charge(alpha, 0.5)
        path = tmp_path / "config.toml"
        path.write_text(
            f"""\
[store]
kind = "redis"
prefix = "{prefix}"

[[auth.keys]]
name = "alpha"
sha256 = "{hash_key(KEY)}"
models = ["mock/*"]
budget_usd = 5
budget_period = "day"

[[auth.keys]]
name = "beta"
sha256 = "{hash_key("other")}"
"""
        )
        done = subprocess.run(
            [NEXUS, "keys", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ},
        )
        assert done.returncode == 0, done.stderr
        header, alpha_line, beta_line = done.stdout.splitlines()
        assert header.startswith("name")
        assert alpha_line.split()[:5] == ["alpha", "mock/*", "5", "day", "0.750000"]
        assert alpha_line.split()[5].endswith("T00:00:00Z")
        assert beta_line.split()[:5] == ["beta", "*", "-", "month", "0.000000"]
    finally:
        await drop_keys(client, prefix)
        await client.aclose()


async def test_nexus_keys_says_a_spend_in_redis_that_is_not_a_number(tmp_path: Path) -> None:
    """(A ValueError traceback, where the other keys' lines were still to print.)"""
    client = await connect_or_skip()
    prefix = new_prefix()
    try:
        win = window("month", dt.datetime.now(dt.UTC).timestamp())
        await client.set(f"{prefix}:spend:alpha:{win.id}", b"abc")
        path = tmp_path / "config.toml"
        path.write_text(
            f'[store]\nkind = "redis"\nprefix = "{prefix}"\n\n'
            f'[[auth.keys]]\nname = "alpha"\nsha256 = "{hash_key(KEY)}"\n\n'
            f'[[auth.keys]]\nname = "beta"\nsha256 = "{hash_key("other")}"\n'
        )
        done = subprocess.run(
            [NEXUS, "keys", "--config", str(path)], capture_output=True, text=True, timeout=20
        )
        assert done.returncode == 0, done.stderr
        _, alpha_line, beta_line = done.stdout.splitlines()
        assert alpha_line.split()[4] == "?"
        assert beta_line.split()[4] == "0.000000"
        assert "Traceback" not in done.stderr
        assert "the spend of 'alpha' in Redis is not a number" in done.stderr
    finally:
        await drop_keys(client, prefix)
        await client.aclose()


def test_nexus_keys_with_the_memory_store_says_where_the_spend_is(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[[auth.keys]]\nname = "alpha"\nsha256 = "{hash_key(KEY)}"\nbudget_usd = 2\n')
    done = subprocess.run(
        [NEXUS, "keys", "--config", str(path)], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    _, line, note = done.stdout.splitlines()
    assert line.split()[:4] == ["alpha", "*", "2", "month"]
    assert "memory store" in note
    bad = tmp_path / "bad.toml"
    bad.write_text('[[auth.keys]]\nname = "a"\nsha256 = "00"\nbudget_period = "week"\n')
    done = subprocess.run([NEXUS, "keys", "--config", str(bad)], capture_output=True, text=True)
    assert done.returncode == 2 and "config error" in done.stderr
    # No ./config.toml where it runs: it read the built-in default and said there were no
    # keys (exit 0), as if the gateway had none.
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    done = subprocess.run([NEXUS, "keys"], capture_output=True, text=True, cwd=empty)
    assert done.returncode == 2, done.stdout
    assert "no ./config.toml here; give --config PATH" in done.stderr


async def test_two_replicas_share_a_keys_budget(tmp_path: Path) -> None:
    """A charge on one replica refuses the next request on the other: the spend is in Redis."""
    from nexus_process import start_nexus, stop_nexus

    client = await connect_or_skip()
    prefix = new_prefix()
    path = tmp_path / "config.toml"
    path.write_text(
        f"""\
[server]
shutdown_grace_s = 0

[store]
kind = "redis"
prefix = "{prefix}"

[[auth.keys]]
name = "alpha"
sha256 = "{hash_key(KEY)}"
budget_usd = 4
budget_period = "total"

[models."mock/echo"]
input_usd_per_mtok = 0
output_usd_per_mtok = 1000000   # a dollar a completion token

[providers.mock]
kind = "mock"
"""
    )
    procs = []
    try:
        urls = []
        for n in range(2):
            proc, match = start_nexus(path, tmp_path / f"nexus{n}.log")
            procs.append(proc)
            urls.append(match.group(1))
        # $3 at most each (its cap), $3 spent.
        three = {**CHAT, "mock": {"content": "one two three"}, "max_tokens": 3}
        one = {**CHAT, "mock": {"content": "one"}, "max_tokens": 1}
        async with aiohttp.ClientSession(headers=BEARER) as http:
            # A streaming request on the first: $3 of $4, charged before its end is read.
            async with http.post(
                urls[0] + "/v1/chat/completions", json={**three, "stream": True}
            ) as resp:
                assert resp.status == 200
                assert b"[DONE]" in await resp.read()
            # On the second, one that may cost $3 more would pass the budget: refused.
            async with http.post(urls[1] + "/v1/chat/completions", json=three) as resp:
                assert resp.status == 429
                error = (await resp.json())["error"]
                assert error["code"] == "budget_exceeded"
                assert "may cost up to $3" in error["message"]
            # One that may cost $1 fits: it runs (non-streaming), and spends the rest.
            async with http.post(urls[1] + "/v1/chat/completions", json=one) as resp:
                assert resp.status == 200, await resp.text()
            # Refused on both, before anything opens.
            for url in urls:
                async with http.post(url + "/v1/chat/completions", json=one) as resp:
                    assert resp.status == 429
                    error = (await resp.json())["error"]
                    assert error["code"] == "budget_exceeded"
                    assert "$4 of its total budget of $4" in error["message"]
        done = subprocess.run(
            [NEXUS, "keys", "--config", str(path)], capture_output=True, text=True, timeout=20
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[1].split() == [
            "alpha", "*", "4", "total", "4.000000", "never"
        ]  # fmt: skip
    finally:
        for proc in procs:
            stop_nexus(proc, gently=False)
        await drop_keys(client, prefix)
        await client.aclose()


async def test_every_way_in_is_charged_and_a_cache_hit_is_free(make_client: MakeClient) -> None:
    prices = {"mock/echo": {"input_usd_per_mtok": 0, "output_usd_per_mtok": 1_000_000}}
    client = await make_client(
        keyed(
            100,
            "total",
            models=prices,
            cache={"enabled": True},
            limits={"budget_max_output_tokens": 10},  # $10 held a request
        )
    )
    limits = client.app[HUB].limits
    alpha = ApiKey("alpha", budget_usd=100, budget_period="total")

    async def chat(script: dict[str, Any], **extra: Any) -> aiohttp.ClientResponse:
        body = {**CHAT, "mock": script, **extra}
        resp = await client.post("/v1/chat/completions", json=body, headers=BEARER)
        await resp.read()
        return resp

    three = {"content": "one two three"}  # $1 a completion token
    assert (await chat(three)).status == 200
    assert await limits.spent(alpha) == pytest.approx(3)
    hit = await chat(three)
    assert hit.headers["X-Nexus-Cache"] == "hit"
    assert await limits.spent(alpha) == pytest.approx(3)  # a replay billed nothing
    # A stream that fails after two chunks: its estimated spend.
    assert (await chat({"content": "a b c d", "fail_after": 2}, stream=True)).status == 200
    assert await limits.spent(alpha) == pytest.approx(5)
    # A WebSocket turn.
    url = str(client.make_url("/v1/realtime")).replace("http", "ws", 1)
    async with websockets.connect(url, additional_headers=BEARER) as ws:
        request = {**CHAT, "mock": {"content": "x y"}}
        await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
        while orjson.loads(await ws.recv())["type"] != "done":
            pass
    assert await limits.spent(alpha) == pytest.approx(7)


async def test_a_long_prompt_left_at_its_first_token_is_charged_its_prompt(
    make_client: MakeClient,
) -> None:
    # The mock, like OpenAI, reports usage last: a client that leaves at the first token
    # would otherwise have spent nothing of its budget on a prompt the upstream bills.
    prices = {"mock/echo": {"input_usd_per_mtok": 1_000_000, "output_usd_per_mtok": 0}}
    client = await make_client(keyed(1000, "total", models=prices))
    limits = client.app[HUB].limits
    alpha = ApiKey("alpha", budget_usd=1000, budget_period="total")
    prompt = [{"role": "user", "content": "w " * 200}]  # 400 bytes: 100 tokens, and 4
    body = {**CHAT, "messages": prompt, "stream": True}
    slow = {**body, "mock": {"content": "a b c d e f", "delay_ms": 200}}
    resp = await client.post("/v1/chat/completions", json=slow, headers=BEARER)
    await resp.content.readuntil(b"\n\n")
    resp.close()
    for _ in range(200):
        if await limits.spent(alpha):
            break
        await asyncio.sleep(0.01)
    assert await limits.spent(alpha) == pytest.approx(104)  # $1 a prompt token
    # Refused before any output: the upstream billed nothing, nor does the budget.
    refused = {**body, "mock": {"fail_after": 0}}
    resp = await client.post("/v1/chat/completions", json=refused, headers=BEARER)
    assert resp.status == 502
    await resp.read()
    await asyncio.sleep(0.05)
    assert await limits.spent(alpha) == pytest.approx(104)


@pytest.mark.parametrize(
    ("reply", "charged"),
    [
        ("accepted", 104),  # 2xx, then a long prefill (or reasoning): the prompt is billed
        ("unanswered", 0),  # the client left before the upstream answered at all
        ("refused", 0),  # a 5xx: nothing billed upstream
        ("failed", 0),  # a 2xx, then an error before any event: a failed stream, uncharged
    ],
)
async def test_a_stream_left_before_its_first_event_is_charged_as_its_upstream_bills(
    make_client: MakeClient, reply: str, charged: int
) -> None:
    from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_error_body

    prices = {"up/m": {"input_usd_per_mtok": 1_000_000, "output_usd_per_mtok": 0}}
    prompt = [{"role": "user", "content": "w " * 200}]  # 400 bytes: 100 tokens, and 4
    body = {"model": "up/m", "messages": prompt, "stream": True}
    chunks = [openai_chunk(content="late"), openai_chunk(finish_reason="stop"), DONE]
    async with FakeUpstream() as up:
        if reply == "accepted":
            up.add(Reply.stream(chunks, delay=[5.0, 0.0, 0.0]))
        elif reply == "unanswered":
            up.add(Reply.stream(chunks, headers_delay=5.0))
        elif reply == "failed":
            error = {"error": {"message": "overloaded", "type": "server_error"}}
            up.add(Reply.stream([b"data: " + orjson.dumps(error) + b"\n\n"]))
        else:
            up.add(Reply.json(500, openai_error_body("down", "server_error")))
        provider = {"kind": "openai", "base_url": up.url + "/v1"}
        client = await make_client(keyed(1000, "total", models=prices, providers={"up": provider}))
        limits = client.app[HUB].limits
        alpha = ApiKey("alpha", budget_usd=1000, budget_period="total")
        request = client.post("/v1/chat/completions", json=body, headers=BEARER)
        with contextlib.suppress(TimeoutError):
            resp = await asyncio.wait_for(request, 0.5)  # the client gives up
            await resp.read()
        for _ in range(300):
            if await limits.spent(alpha) or not client.app[HUB].live:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert await limits.spent(alpha) == pytest.approx(charged)


async def test_racing_streams_cannot_spend_past_the_budget(make_client: MakeClient) -> None:
    """Each request holds its worst case while it runs: 20 streams started at once on a
    $10 budget, each able to cost $3, admit three; the rest are refused, and told why."""
    prices = {"mock/echo": {"input_usd_per_mtok": 0, "output_usd_per_mtok": 1_000_000}}
    client = await make_client(keyed(10, "total", models=prices))
    alpha = ApiKey("alpha", budget_usd=10, budget_period="total")
    slow = {**CHAT, "stream": True, "max_tokens": 3, "mock": {"content": "a b", "delay_ms": 300}}

    async def one() -> tuple[int, str]:
        resp = await client.post("/v1/chat/completions", json=slow, headers=BEARER)
        return resp.status, (await resp.read()).decode()

    answers = await asyncio.gather(*(one() for _ in range(20)))
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200] * 3 + [429] * 17
    refusal = next(text for status, text in answers if status == 429)
    assert "may cost up to $3" in refusal and "running streams hold $" in refusal
    spent = await client.app[HUB].limits.spent(alpha)
    assert spent == pytest.approx(6)  # two tokens each: the holds gave back the rest
    # Nothing is held once they ended: one more fits ($6 + $3 <= $10), then none.
    fits = {**slow, "mock": {"content": "a b c"}}
    resp = await client.post("/v1/chat/completions", json=fits, headers=BEARER)
    assert resp.status == 200
    await resp.read()
    resp = await client.post("/v1/chat/completions", json=fits, headers=BEARER)
    assert resp.status == 429  # $9 + $3 > $10, nothing held: a total budget, no retry
    assert "Retry-After" not in resp.headers
    assert "running streams hold" not in (await resp.json())["error"]["message"]


async def test_a_request_without_a_cap_is_sent_with_the_budgets_cap(
    make_client: MakeClient,
) -> None:
    """One stream without max_tokens could otherwise run a key far past its budget (200k
    tokens on a $0.01 budget): it is sent with [limits] budget_max_output_tokens."""
    prices = {"mock/echo": {"input_usd_per_mtok": 0, "output_usd_per_mtok": 1_000_000}}
    config = keyed(5, "total", models=prices, limits={"budget_max_output_tokens": 2})
    client = await make_client(config)
    alpha = ApiKey("alpha", budget_usd=5, budget_period="total")
    long = {**CHAT, "mock": {"content": "a b c d e f g h"}}
    resp = await client.post("/v1/chat/completions", json=long, headers=BEARER)
    assert resp.status == 200
    body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    assert await client.app[HUB].limits.spent(alpha) == pytest.approx(2)
    # A request's own cap is its own: one that may cost more than is left is refused.
    resp = await client.post("/v1/chat/completions", json={**long, "max_tokens": 4}, headers=BEARER)
    assert resp.status == 429
    assert "may cost up to $4" in (await resp.json())["error"]["message"]
    # A key without a budget is sent as it asked.
    assert (await client.post("/v1/chat/completions", json=long)).status == 401


async def test_holds_are_shared_by_replicas_and_go_with_their_slots_lease() -> None:
    """In Redis a hold is checked and taken in the admission script, so two replicas
    cannot both take the budget's rest; a charge replaces its stream's hold in one
    script; a replica that dies leaves its holds only until their slots' lease ends."""
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    client = await connect_or_skip()
    prefix = new_prefix()
    key = ApiKey("alpha", budget_usd=10.0, budget_period="total")

    def replica() -> RedisLimits:
        store = RedisStore(prefix=prefix, client=client)
        return RedisLimits(store, rate=0, per_key=None, lease_s=0.5, fallback=LocalLimits(0, None))

    one, two = replica(), replica()
    try:
        first = await one.admit(key, stream=True, hold=4.0)
        second = await two.admit(key, stream=True, hold=4.0)
        assert first is not None and second is not None  # $8 of $10 held
        with pytest.raises(BudgetExceeded) as refused:
            await one.admit(key, stream=True, hold=4.0)
        assert "running streams hold $8" in refused.value.message
        await two.charge(key, 1.0, second)  # its real cost, in place of its $4
        third = await one.admit(key, stream=True, hold=4.0)  # $1 + $4 + $4 <= $10
        assert third is not None
        assert await one.spent(key) == pytest.approx(1.0)
        with pytest.raises(BudgetExceeded):
            await two.admit(key, stream=True, hold=2.0)
        # The first replica dies with its two holds (its ticker never renews them).
        await asyncio.sleep(0.7)
        assert await two.admit(key, stream=True, hold=9.0) is not None
    finally:
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_replica_back_from_a_stall_renews_its_holds_with_its_slots() -> None:
    """A replica that stalled past its lease (a pause, a partition) finds its slots and
    their holds dropped by another replica's admission. Its renewal put the slots back
    but not the holds, so its streams, still running, were held by nobody: the key went
    on being admitted and spent past its budget. Slot and hold come back together, and
    so does a slot and hold that Redis lost."""
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    client = await connect_or_skip()
    prefix = new_prefix()
    key = ApiKey("alpha", budget_usd=10.0, budget_period="total")
    slots, holds = f"{prefix}:limits:streams:alpha", f"{prefix}:limits:held:alpha"

    def replica() -> RedisLimits:
        store = RedisStore(prefix=prefix, client=client)
        return RedisLimits(store, rate=0, per_key=None, lease_s=60, fallback=LocalLimits(0, None))

    stalled, other = replica(), replica()
    try:
        mine = [await stalled.admit(key, stream=True, hold=4.0) for _ in range(2)]
        assert all(slot is not None for slot in mine)  # $8 of $10 held
        # The stall: its leases lapse (no renewal came), and an admission elsewhere drops
        # them with their holds.
        await client.zadd(slots, {slot.id: 1 for slot in mine if slot is not None})
        theirs = [await other.admit(key, stream=True, hold=4.0) for _ in range(2)]
        assert all(slot is not None for slot in theirs)
        assert await client.hlen(holds) == 2
        # Back from the stall, it renews: its two streams still run, and hold again.
        await stalled._renew()
        assert await client.zcard(slots) == 4
        assert await client.hlen(holds) == 4
        with pytest.raises(BudgetExceeded) as refused:  # $16 held: nothing more is admitted
            await other.admit(key, stream=True, hold=0.5)
        assert "running streams hold $16" in refused.value.message
        # A charged stream's hold is gone for good: a renewal does not bring it back.
        first = mine[0]
        assert first is not None
        await stalled.charge(key, 1.0, first)
        await stalled._renew()
        assert await client.hlen(holds) == 3
        # Redis lost them all (a restart without persistence): back at the next renewal.
        await client.delete(slots, holds)
        await stalled._renew()
        await other._renew()
        assert await client.hlen(holds) == 3
        with pytest.raises(BudgetExceeded) as refused:
            await other.admit(key, stream=True, hold=0.5)
        assert "running streams hold $12" in refused.value.message
    finally:
        await drop_keys(client, prefix)
        await client.aclose()


async def test_an_anthropic_stream_left_during_prefill_is_charged_the_upstreams_counts(
    make_client: MakeClient,
) -> None:
    """Anthropic counts the prompt in ``message_start``, before any output: a client that
    leaves then is charged those counts (cache reads and writes at their prices), not the
    estimate from the request's bytes."""
    from upstreams import FakeUpstream, Reply, sse

    price = {
        "input_usd_per_mtok": 1_000_000,
        "cached_input_usd_per_mtok": 100_000,
        "cache_write_usd_per_mtok": 1_250_000,
        "output_usd_per_mtok": 0,
    }
    usage = {
        "input_tokens": 100,
        "cache_read_input_tokens": 10_000,
        "cache_creation_input_tokens": 2_000,
        "output_tokens": 1,
    }
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        },
    }
    late = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    chunks = [sse(start, "message_start"), sse(late, "content_block_start")]
    async with FakeUpstream() as up:
        up.add(Reply.stream(chunks, delay=[0.0, 5.0]))
        provider = {"kind": "anthropic", "base_url": up.url}
        config = keyed(100_000, "total", models={"up/m": price}, providers={"up": provider})
        client = await make_client(config)
        limits = client.app[HUB].limits
        alpha = ApiKey("alpha", budget_usd=100_000, budget_period="total")
        body = {**CHAT, "model": "up/m", "stream": True, "max_tokens": 10}
        with contextlib.suppress(TimeoutError):
            resp = await asyncio.wait_for(
                client.post("/v1/chat/completions", json=body, headers=BEARER), 0.5
            )
            await asyncio.wait_for(resp.read(), 0.5)
        for _ in range(300):
            if await limits.spent(alpha):
                break
            await asyncio.sleep(0.01)
        # 100 at $1, 10,000 at $0.10 and 2,000 at $1.25 (a token each, per the prices above).
        assert await limits.spent(alpha) == pytest.approx(100 + 1_000 + 2_500)


async def test_the_cap_sent_upstream_is_the_one_held(make_client: MakeClient) -> None:
    """Both cap fields sent: an upstream may obey either, so both go as the smaller, which
    is what the budget held. Without a cap, a target's own smaller default (Anthropic's
    default_max_tokens) is kept, not raised to [limits] budget_max_output_tokens."""
    from upstreams import DONE, FakeUpstream, Reply, openai_chunk

    price = {"input_usd_per_mtok": 0, "output_usd_per_mtok": 1}
    chunks = [openai_chunk(content="hi"), openai_chunk(finish_reason="stop"), DONE]
    async with FakeUpstream(default=Reply.stream(chunks)) as oa, FakeUpstream() as an:
        an.add(Reply.json(500, {"type": "error", "error": {"type": "api_error", "message": "x"}}))
        providers = {
            "oa": {"kind": "openai", "base_url": oa.url + "/v1"},
            "an": {"kind": "anthropic", "base_url": an.url, "default_max_tokens": 4096},
        }
        models = {"oa/m": price, "an/m": price}
        client = await make_client(keyed(1000, "total", models=models, providers=providers))
        both = {**CHAT, "model": "oa/m", "max_tokens": 1_000_000, "max_completion_tokens": 5}
        resp = await client.post("/v1/chat/completions", json=both, headers=BEARER)
        assert resp.status == 200, await resp.text()
        sent = oa.requests[-1].body
        assert (sent["max_tokens"], sent["max_completion_tokens"]) == (5, 5)
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "model": "oa/m"}, headers=BEARER
        )
        assert resp.status == 200
        assert oa.requests[-1].body["max_completion_tokens"] == 16_384
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "model": "an/m"}, headers=BEARER
        )
        await resp.read()
        assert an.requests[-1].body["max_tokens"] == 4096


@pytest.mark.parametrize(
    ("spent", "held", "hold", "retry"),
    [
        (0.0, 0.0, 20.0, None),  # more than the whole budget: never, whatever the wait
        (8.0, 1.0, 1.5, "1"),  # fits once the running stream ends
        (8.0, 1.0, 3.0, "60"),  # fits only in the next window
        (10.0, 0.0, 1.0, "60"),  # spent: the next window
    ],
)
def test_a_budget_refusal_says_when_a_retry_can_pass(
    monkeypatch: pytest.MonkeyPatch, spent: float, held: float, hold: float, retry: str | None
) -> None:
    from nexus.cache.limits import budget_exceeded

    key = ApiKey("alpha", budget_usd=10.0, budget_period="day")
    refused = budget_exceeded(key, spent, at("2026-11-25T23:59:00"), held, hold)
    assert refused.headers.get("Retry-After") == retry

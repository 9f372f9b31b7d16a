"""The accounting record on a real ``nexus serve``: the JSON access line and /metrics say
what each request did (its outcome), what it used and what it cost, to the token."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import hash_key
from nexus_process import start_nexus, stop_nexus
from support import METRICS_TOKEN, METRICS_TOKEN_ENV, SCRAPER
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk, sse

KEY = "nx-accounting-key-0042"
KEY_ENV = "NEXUS_TEST_ACCOUNTING_UPSTREAM_KEY"
CHAT = "/v1/chat/completions"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-upstream")
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN)


def config(openai_url: str, anthropic_url: str) -> str:
    return f"""
[server]
heartbeat_interval_s = 0.5
shutdown_grace_s = 0.5

[logging]
format = "json"

[metrics]
token_env = "{METRICS_TOKEN_ENV}"

[streams]
detach_timeout_s = 0.2

[[auth.keys]]
name = "team-a"
sha256 = "{hash_key(KEY)}"

[providers.mock]
kind = "mock"
models = ["echo"]

[providers.oai]
kind = "openai"
base_url = "{openai_url}/v1"
api_key_env = "{KEY_ENV}"
models = ["gpt-x"]

[providers.claude]
kind = "anthropic"
base_url = "{anthropic_url}"
api_key_env = "{KEY_ENV}"
models = ["opus"]

[models."oai/gpt-x"]
input_usd_per_mtok = 2.5
output_usd_per_mtok = 10.0
cached_input_usd_per_mtok = 1.25

[models."claude/opus"]
input_usd_per_mtok = 15
output_usd_per_mtok = 75
cached_input_usd_per_mtok = 1.5
cache_write_usd_per_mtok = 18.75

[models."mock/echo"]
input_usd_per_mtok = 1
output_usd_per_mtok = 2
"""


@contextlib.contextmanager
def serve(tmp_path: Path, text: str) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    path = tmp_path / "config.toml"
    path.write_text(text)
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(path, log)
    try:
        yield match.group(1), log, proc
    finally:
        stop_nexus(proc)


def access_lines(log: Path) -> dict[str, dict[str, Any]]:
    """The access lines, by the id each request's client gave it (X-Client-Request-Id)."""
    lines = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if record.get("logger") == "nexus.access" and "client_request_id" in record:
                lines[record["client_request_id"]] = record
    return lines


async def wait_for_line(log: Path, request_id: str) -> dict[str, Any]:
    for _ in range(100):
        found = access_lines(log).get(request_id)
        if found is not None:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}:\n{log.read_text()}")


def anthropic_event(name: str, **fields: Any) -> bytes:
    return sse({"type": name, **fields}, event=name)


ANTHROPIC = [
    anthropic_event(
        "message_start",
        message={
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "opus",
            "usage": {
                "input_tokens": 100,
                "output_tokens": 1,
                "cache_read_input_tokens": 50,
                "cache_creation_input_tokens": 10,
            },
        },
    ),
    anthropic_event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    anthropic_event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hello"}),
    anthropic_event("content_block_stop", index=0),
    anthropic_event(
        "message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 20}
    ),
    anthropic_event("message_stop"),
]
OPENAI = [
    openai_chunk(content="Hi"),
    openai_chunk(finish_reason="stop"),
    openai_usage_chunk(
        {
            "prompt_tokens": 1200,
            "completion_tokens": 300,
            "total_tokens": 1500,
            "prompt_tokens_details": {"cached_tokens": 1000},
            "completion_tokens_details": {"reasoning_tokens": 120},
        }
    ),
    DONE,
]


def body(model: str, content: str = "x", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def post(
    session: aiohttp.ClientSession, url: str, request_id: str, payload: dict[str, Any]
) -> tuple[int, bytes]:
    headers = {**HEADERS, "X-Client-Request-Id": request_id}
    async with session.post(url + CHAT, json=payload, headers=headers) as resp:
        return resp.status, await resp.read()


async def test_access_line_and_metrics_account_for_every_outcome(tmp_path: Path) -> None:
    async with FakeUpstream() as oai, FakeUpstream() as claude:
        oai.add(Reply.stream(OPENAI))
        claude.add(Reply.stream(ANTHROPIC, path="/v1/messages"))
        with serve(tmp_path, config(oai.url, claude.url)) as (url, log, _):
            async with aiohttp.ClientSession() as session:
                status, _ = await post(session, url, "r-oai", body("oai/gpt-x", stream=True))
                assert status == 200
                status, _ = await post(session, url, "r-claude", body("claude/opus", stream=True))
                assert status == 200
                status, _ = await post(session, url, "r-json", body("mock/echo", "a b c"))
                assert status == 200
                cut = body("mock/echo", "one two three four", stream=True, mock={"fail_after": 2})
                status, raw = await post(session, url, "r-cut", cut)
                assert status == 200 and b"event: error" in raw
                status, _ = await post(session, url, "r-404", body("nope/x", stream=True))
                assert status == 404
                slow = body("mock/echo", "a b c d e f g h", stream=True, mock={"delay_ms": 300})
                headers = {**HEADERS, "X-Client-Request-Id": "r-gone"}
                async with session.post(url + CHAT, json=slow, headers=headers) as resp:
                    await resp.content.readuntil(b"\n\n")
                    resp.close()
                for request_id in ("r-oai", "r-gone"):
                    await wait_for_line(log, request_id)
                lines = access_lines(log)
                async with session.get(url + "/metrics", headers=SCRAPER) as resp:
                    metrics = await resp.text()

    oai_line = lines["r-oai"]
    assert oai_line["level"] == "info"
    expected_oai = {
        "method": "POST",
        "path": CHAT,
        "status": 200,
        "outcome": "ok",
        "model": "oai/gpt-x",
        "served": "oai/gpt-x",
        "key": "team-a",
        "client": "127.0.0.1",
        "prompt_tokens": 1200,
        "completion_tokens": 300,
        "cached_tokens": 1000,
        "reasoning_tokens": 120,
        "cost_usd": round((200 * 2.5 + 1000 * 1.25 + 300 * 10.0) / 1e6, 10),
        "estimated": None,
    }
    assert {k: oai_line.get(k) for k in expected_oai} == expected_oai
    assert oai_line["events"] > 0 and oai_line["bytes"] > 0

    claude_line = lines["r-claude"]
    # Anthropic: prompt = input + cache reads + cache writes; cache writes at their own price.
    expected_claude = {
        "outcome": "ok",
        "served": "claude/opus",
        "prompt_tokens": 160,
        "completion_tokens": 20,
        "cached_tokens": 50,
        "cache_write_tokens": 10,
        "cost_usd": round((100 * 15 + 50 * 1.5 + 10 * 18.75 + 20 * 75) / 1e6, 10),
    }
    assert {k: claude_line.get(k) for k in expected_claude} == expected_claude

    json_line = lines["r-json"]
    assert (json_line["outcome"], json_line["format"]) == ("ok", "application/json")
    assert "events" not in json_line or json_line["events"] is None  # no stream was written
    assert (json_line["prompt_tokens"], json_line["completion_tokens"]) == (3, 3)
    assert json_line["cost_usd"] == round((3 * 1 + 3 * 2) / 1e6, 10)

    cut_line = lines["r-cut"]
    assert cut_line["level"] == "warning"
    assert (cut_line["status"], cut_line["outcome"]) == (200, "mid_stream_error:upstream_error")
    assert (cut_line["completion_tokens"], cut_line["estimated"]) == (2, True)

    missing = lines["r-404"]
    assert missing["level"] == "warning"
    assert (missing["status"], missing["outcome"]) == (404, "error:model_not_found")

    gone = lines["r-gone"]
    assert gone["level"] == "warning"
    assert gone["outcome"] == "cancelled:client_disconnect"
    # Its stream ended with it (not resumable): the line has what it spent so far, and
    # the prompt the upstream billed, estimated ("a b c d e f g h": 15 bytes, 4 + 4 tokens).
    assert gone["estimated"] is True
    assert gone["completion_tokens"] >= 1
    assert gone["prompt_tokens"] == 8

    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples.get((name, frozenset(labels.items())), 0.0)

    requests = "nexus_requests_total"
    assert value(requests, endpoint=CHAT, model="oai/gpt-x", outcome="ok") == 1
    assert value(requests, endpoint=CHAT, model="mock/echo", outcome="ok") == 1
    mid = "mid_stream_error:upstream_error"
    assert value(requests, endpoint=CHAT, model="mock/echo", outcome=mid) == 1
    assert value(requests, endpoint=CHAT, model="nope/x", outcome="error:model_not_found") == 0
    assert value(requests, endpoint=CHAT, model="unknown", outcome="error:model_not_found") == 1
    assert (
        value(requests, endpoint=CHAT, model="mock/echo", outcome="cancelled:client_disconnect")
        == 1
    )
    tokens = "nexus_tokens_total"
    oai_key = {"model": "oai/gpt-x", "key": "team-a"}
    assert value(tokens, kind="prompt", **oai_key) == 1200
    assert value(tokens, kind="completion", **oai_key) == 300
    assert value(tokens, kind="cached", **oai_key) == 1000
    assert value(tokens, kind="reasoning", **oai_key) == 120
    assert value("nexus_cost_usd_total", **oai_key) == pytest.approx(0.00475)
    claude_key = {"model": "claude/opus", "key": "team-a"}
    assert value(tokens, kind="cached", **claude_key) == 50
    assert value(tokens, kind="cache_write", **claude_key) == 10
    assert value("nexus_cost_usd_total", **claude_key) == pytest.approx(0.0032625)
    assert value("nexus_upstream_errors_total", provider="mock", code="upstream_error") == 1
    assert "_created" not in metrics
    assert '="-"' not in metrics and '=""' not in metrics


async def test_a_stream_cut_by_shutdown_is_not_a_success(tmp_path: Path) -> None:
    async with FakeUpstream() as oai, FakeUpstream() as claude:
        with serve(tmp_path, config(oai.url, claude.url)) as (url, log, proc):
            slow = body("mock/echo", " ".join(["w"] * 50), stream=True, mock={"delay_ms": 100})
            headers = {**HEADERS, "X-Client-Request-Id": "r-shutdown"}
            async with (
                aiohttp.ClientSession() as session,
                session.post(url + CHAT, json=slow, headers=headers) as resp,
            ):
                await resp.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                rest = await resp.read()
            assert b"server_shutting_down" in rest
            line = await wait_for_line(log, "r-shutdown")
    assert line["level"] == "warning"
    assert (line["status"], line["outcome"]) == (200, "cancelled:shutdown")
    assert line["completion_tokens"] > 0 and line["estimated"] is True

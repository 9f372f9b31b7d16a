"""Accounting under an adversarial tenant and a hostile upstream: what review found.

Each test reproduces a way the numbers an operator relies on could be escaped or
blown up, on a real ``nexus serve`` where it needs one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import hash_key
from nexus_process import start_nexus, stop_nexus
from upstreams import FakeUpstream, Reply, openai_chunk, sse

KEY = "nx-accounting-review-0042"
BEARER = {"Authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def serve(tmp_path: Path, text: str) -> Iterator[str]:
    path = tmp_path / "config.toml"
    path.write_text(text)
    proc, match = start_nexus(path, tmp_path / "nexus.log")
    try:
        yield match.group(1)
    finally:
        stop_nexus(proc, gently=False)


BUDGETED = f"""
[[auth.keys]]
name = "tenant"
sha256 = "{hash_key(KEY)}"
budget_usd = 0.000001
budget_period = "total"

[providers.mock]
kind = "mock"
models = ["echo"]

[models."mock/echo"]             # the one model the operator priced
input_usd_per_mtok = 1000
output_usd_per_mtok = 1000

[models."cheap"]                 # an alias without a price of its own, one target priced
targets = ["mock/echo", "mock/other"]
"""


async def test_a_key_with_a_budget_cannot_spend_on_a_model_without_a_price(
    tmp_path: Path,
) -> None:
    """A model without a price has no cost, so it was never charged: a key with a budget
    ran it for free, forever. Fail closed, as for a budget Redis cannot check."""
    chat = {"messages": [{"role": "user", "content": "one two three"}]}
    with serve(tmp_path, BUDGETED) as url:
        async with aiohttp.ClientSession(url) as http:
            for model in ("mock/other", "cheap"):
                for stream in (False, True):
                    body = {**chat, "model": model, "stream": stream}
                    async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                        assert r.status == 403, (model, stream, await r.text())
                        error = (await r.json())["error"]
                        assert error["code"] == "model_not_priced"
                        assert model in error["message"]
            # An unknown model is still the 404 it always was.
            body = {**chat, "model": "nope/x"}
            async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                assert r.status == 404
            # The priced model is charged, and the budget then holds.
            body = {**chat, "model": "mock/echo"}
            async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                assert r.status == 200
            async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "budget_exceeded"


UPSTREAM_KEY_ENV = "NEXUS_TEST_REVIEW_UPSTREAM_KEY"


def hostile_upstream(url: str) -> str:
    return f"""
[providers.oai]
kind = "openai"
base_url = "{url}/v1"
api_key_env = "{UPSTREAM_KEY_ENV}"
models = ["gpt-x"]
"""


async def test_an_upstreams_error_codes_cannot_mint_metric_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code of an error inside an upstream's stream went verbatim into the labels of
    ``nexus_upstream_errors_total`` and ``nexus_requests_total{outcome}``: an upstream (any
    OpenAI-compatible server) that puts an id in its codes grows /metrics without bound."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, "sk-upstream")
    count = 120
    async with FakeUpstream() as fake:
        for i in range(count):
            error = sse(
                {"error": {"code": f"busy_{i:04d}", "type": "server_error", "message": "x"}}
            )
            # Half fail mid-stream (after a delta), half before any output (an HTTP error).
            head = [openai_chunk(content="Hi")] if i % 2 else []
            fake.add(Reply.stream([*head, error]))
        with serve(tmp_path, hostile_upstream(fake.url)) as url:
            async with aiohttp.ClientSession(url) as http:
                body = {
                    "model": "oai/gpt-x",
                    "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                for i in range(count):
                    async with http.post("/v1/chat/completions", json=body) as r:
                        text = await r.text()
                        assert f"busy_{i:04d}" in text  # the client still gets the code
                async with http.get("/metrics") as r:
                    metrics = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    codes = {s.labels["code"] for s in families["nexus_upstream_errors"].samples}
    outcomes = {s.labels["outcome"] for s in families["nexus_requests"].samples}
    assert len(codes) <= 65, sorted(codes)
    assert len(outcomes) <= 2 * 65, sorted(outcomes)
    assert "other" in codes

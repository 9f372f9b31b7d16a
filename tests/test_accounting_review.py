"""Accounting under an adversarial tenant and a hostile upstream: what review found.

Each test reproduces a way the numbers an operator relies on could be escaped or
blown up, on a real ``nexus serve`` where it needs one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from nexus.auth import hash_key
from nexus_process import start_nexus, stop_nexus

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

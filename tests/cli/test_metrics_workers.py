"""``/metrics`` with several worker processes: any worker reports the whole server.

Real processes, forked as ``nexus serve --workers N`` forks them: each calls
:func:`enable_multiprocess` and builds its own app on its own port here (the
kernel's share of one port would not let the test pick a worker).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import warnings
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.server.app import create_app
from nexus.server.metrics import enable_multiprocess, mark_worker_dead
from support import MakeClient, chat, parse_sse

CHAT = "/v1/chat/completions"
SSE = "text/event-stream"
FAILING = {"plugins": [{"path": "test_metrics_workers:Failing"}]}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Failing:
    """A plugin whose end-of-stream hook raises: one hook error per completed stream."""

    async def on_stream_completed(self, *args: Any) -> None:
        raise RuntimeError("a plugin bug, on purpose")


# --- the workers ----------------------------------------------------------------------


class Worker:
    def __init__(self, process: BaseProcess, port: int) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)


def _worker_main(directory: str, conn: Connection) -> None:
    """A worker's life after the fork, as the supervisor's: multiprocess metrics, then the app."""
    enable_multiprocess(directory)
    asyncio.run(_serve(conn))


async def _serve(conn: Connection) -> None:
    app = create_app(parse_config(FAILING), registry=default_registry.copy())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    conn.send(runner.addresses[0][1])
    conn.close()
    await asyncio.Event().wait()  # until killed


class Workers:
    """Forks workers sharing one metrics directory; :meth:`stop_all` kills those left."""

    def __init__(self, directory: Path) -> None:
        self.directory = str(directory)
        self._context = multiprocessing.get_context("fork")
        self._started: list[BaseProcess] = []

    def start(self) -> Worker:
        receive, send = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_worker_main, args=(self.directory, send), daemon=True
        )
        with warnings.catch_warnings():  # Python 3.12+ frowns on forking a threaded process
            warnings.filterwarnings(
                "ignore", "This process .* is multi-threaded", DeprecationWarning
            )
            process.start()
        self._started.append(process)
        send.close()
        try:
            if not receive.poll(10):
                raise AssertionError("the worker did not report its port")
            port: int = receive.recv()
        finally:
            receive.close()
        return Worker(process, port)

    def stop_all(self) -> None:
        for process in self._started:
            if process.is_alive():
                process.kill()
            process.join(5)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    directory = tmp_path / "metrics"  # the supervisor's part: make it, remove it
    directory.mkdir()
    forked = Workers(directory)
    try:
        yield forked
    finally:
        forked.stop_all()


async def scrape(session: aiohttp.ClientSession, worker: Worker) -> Samples:
    async with session.get(f"{worker.url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert "_created" not in text  # not exported in multiprocess mode
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` (0 if absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


# --- the tests ------------------------------------------------------------------------


def test_metrics_add_up_every_worker(workers: Workers) -> None:
    one, two = workers.start(), workers.start()
    asyncio.run(_add_up(workers, one, two))


async def _add_up(workers: Workers, one: Worker, two: Worker) -> None:
    async with aiohttp.ClientSession() as session:
        bodies = []
        for worker in (one, two):
            async with session.post(f"{worker.url}{CHAT}", json=chat("a b c", stream=True)) as resp:
                assert resp.status == 200
                assert resp.content_type == SSE
                bodies.append(await resp.read())
        await asyncio.sleep(0.05)  # the access middleware counts once the handler returned

        samples = await scrape(session, one)  # two was never scraped: its counts are in its file
        ok = {"endpoint": CHAT, "model": "mock/echo", "outcome": "ok"}
        assert value(samples, "nexus_requests_total", **ok) == 2
        tokens = {"model": "mock/echo", "key": "anonymous"}
        assert value(samples, "nexus_tokens_total", kind="prompt", **tokens) == 6
        assert value(samples, "nexus_tokens_total", kind="completion", **tokens) == 6
        assert not any(name.endswith("_created") for name, _ in samples)
        assert value(samples, "nexus_bytes_out_total", format=SSE) == sum(map(len, bodies))
        events = sum(len(parse_sse(body)) for body in bodies)
        assert value(samples, "nexus_events_out_total", format=SSE) == events
        for histogram, labels in (
            ("nexus_time_to_first_byte_seconds", {"endpoint": CHAT, "format": SSE}),
            ("nexus_time_to_first_token_seconds", {"model": "mock/echo"}),
            ("nexus_stream_duration_seconds", {"model": "mock/echo"}),
        ):
            assert value(samples, f"{histogram}_count", **labels) == 2
            assert value(samples, f"{histogram}_bucket", le="+Inf", **labels) == 2
            assert value(samples, f"{histogram}_sum", **labels) > 0
        # Counted as each error happened, not when its worker was last scraped.
        assert value(samples, "nexus_hook_errors_total", hook="on_stream_completed") == 2
        assert value(samples, "nexus_active_streams") == 0
        assert await scrape(session, two) == samples  # any worker answers for all

        # One stream held open on each worker: the live gauge adds them up.
        held = []
        for worker in (one, two):
            body = chat("x y z", stream=True, mock={"delay_ms": 60_000})
            resp = await session.post(f"{worker.url}{CHAT}", json=body)
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            held.append(resp)
        try:
            assert value(await scrape(session, one), "nexus_active_streams") == 2

            two.kill()  # mid-stream: its gauge file still says 1 until it is marked dead
            assert value(await scrape(session, one), "nexus_active_streams") == 2
            mark_worker_dead(workers.directory, two.pid)
            samples = await scrape(session, one)
            assert value(samples, "nexus_active_streams") == 1
            # What the dead worker did still counts.
            total = value(samples, "nexus_requests_total", **ok)
            assert total == 2
            assert value(samples, "nexus_bytes_out_total", format=SSE) > sum(map(len, bodies))
        finally:
            for resp in held:
                resp.close()


def test_enable_multiprocess_needs_the_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        enable_multiprocess(str(tmp_path / "missing"))
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


# --- one process: hook errors are counted as they happen too ---------------------------


async def test_hook_errors_counted_once_each(make_client: MakeClient) -> None:
    client = await make_client(FAILING)
    for _ in range(2):
        resp = await client.post(CHAT, json=chat(stream=True))
        await resp.read()
    for _ in range(2):  # a second scrape adds nothing
        resp = await client.get("/metrics")
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        (sample,) = families["nexus_hook_errors"].samples
        assert (sample.name, sample.labels, sample.value) == (
            "nexus_hook_errors_total",
            {"hook": "on_stream_completed"},
            2,
        )

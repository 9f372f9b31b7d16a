"""``nexus serve --workers N`` as real processes: one port, restarts, SIGTERM, shared resume."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from nexus_process import NEXUS, start_nexus, stop_nexus
from redis_support import REDIS_URL, connect_or_skip, drop_keys, new_prefix

CHAT = "/v1/chat/completions"
SERVING = re.compile(r"Nexus serving on (http://\S+) with (\d+) workers")


class Supervised:
    """A ``nexus serve --workers N`` process and its log."""

    def __init__(
        self, config: Path, *args: str, ready: re.Pattern[str] = SERVING, **how: Any
    ) -> None:
        self.log = config.parent / "nexus.log"
        self.proc, match = start_nexus(config, self.log, *args, ready=ready, **how)
        self.url = match.group(1)

    @property
    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines(keepends=True)

    def wait_for(
        self, pattern: re.Pattern[str], timeout: float = 20, after: int = 0
    ) -> re.Match[str]:
        """The first line from line ``after`` on that matches ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                match = pattern.search(line)
                if match:
                    return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no {pattern.pattern!r} in the log:\n" + "".join(self.lines))

    def workers(self) -> set[int]:
        """The supervisor's live child processes."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        ).stdout
        return {int(pid) for pid in out.split()}

    def stop(self) -> None:
        workers = self.workers()
        stop_nexus(self.proc, gently=False)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        "[server]\nshutdown_grace_s = 5\n\n"
        '[providers.mock]\nkind = "mock"\n\n[store]\nkind = "memory"\n'
    )
    return path


@pytest.fixture
def two(config: Path) -> Iterator[Supervised]:
    server = Supervised(config, "--workers", "2")
    yield server
    server.stop()


async def pids_seen(url: str, connections: int = 24) -> set[int]:
    """The worker pids that answer ``/healthz`` over fresh connections."""
    seen = set()
    for _ in range(connections):
        async with aiohttp.ClientSession() as http, http.get(url + "/healthz") as resp:
            seen.add((await resp.json())["pid"])
    return seen


async def worker_of(http: aiohttp.ClientSession, url: str) -> int:
    """The pid of the worker behind ``http``'s kept-alive connection."""
    async with http.get(url + "/healthz") as resp:
        pid: int = (await resp.json())["pid"]
        return pid


def chat_body(text: str, **extra: object) -> dict[str, object]:
    return {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        **extra,
    }


def contents(body: bytes) -> str:
    return "".join(
        choice["delta"].get("content") or ""
        for line in body.split(b"\n")
        if line.startswith(b"data: {")
        for choice in orjson.loads(line[6:])["choices"]
    )


async def test_two_workers_share_the_port(two: Supervised) -> None:
    workers = two.workers()
    assert len(workers) == 2
    assert await pids_seen(two.url) == workers
    async with (
        aiohttp.ClientSession() as http,
        http.post(two.url + CHAT, json=chat_body("one two three")) as resp,
    ):
        assert resp.status == 200
        body = await resp.read()
    assert contents(body) == "one two three"
    assert body.endswith(b"data: [DONE]\n\n")


async def test_a_worker_that_dies_is_restarted(two: Supervised) -> None:
    before = two.workers()
    victim = min(before)
    mark = len(two.lines)
    os.kill(victim, signal.SIGKILL)
    two.wait_for(re.compile(rf"worker \d \(pid {victim}\) died \(killed by SIGKILL\)"), after=mark)
    two.wait_for(re.compile(r"worker \d \(pid \d+\) ready"), after=mark)
    after = two.workers()
    assert len(after) == 2 and victim not in after
    assert await pids_seen(two.url) == after


def test_sigterm_lets_running_streams_finish_then_stops_every_worker(two: Supervised) -> None:
    workers = two.workers()
    body = orjson.dumps(chat_body("a b c d e f", mock={"delay_ms": 150}))
    curl = subprocess.Popen(
        ["curl", "-sN", two.url + CHAT, "-H", "Content-Type: application/json", "-d", body],
        stdout=subprocess.PIPE,
    )
    time.sleep(0.4)  # the stream is on its way
    two.proc.send_signal(signal.SIGTERM)
    out, _ = curl.communicate(timeout=15)
    assert contents(out) == "a b c d e f"  # finished inside the grace period
    assert out.endswith(b"data: [DONE]\n\n")
    assert two.proc.wait(15) == 0
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    log = "".join(two.lines)
    assert log.count(") stopped") == 2
    assert "died" not in log
    # Two workers' lines interleave in one log: each names its worker.
    assert "INFO worker=0 nexus" in log and "INFO worker=1 nexus" in log


def test_one_signal_to_the_process_group_stops_gracefully(config: Path) -> None:
    """Ctrl-C, or systemd's control-group kill: each worker got the signal twice (the
    kernel's, its supervisor's) and took the second for "hurry": no drain, no grace,
    its streams cut at once."""
    group = Supervised(config, "--workers", "2", session=True)
    try:
        body = orjson.dumps(chat_body("a b c d e f", mock={"delay_ms": 150}))
        curl = subprocess.Popen(
            ["curl", "-sN", group.url + CHAT, "-H", "Content-Type: application/json", "-d", body],
            stdout=subprocess.PIPE,
        )
        time.sleep(0.4)  # the stream is on its way
        os.killpg(group.proc.pid, signal.SIGINT)
        out, _ = curl.communicate(timeout=15)
        assert contents(out) == "a b c d e f"  # finished inside the grace period
        assert group.proc.wait(15) == 0
        assert "cut short" not in "".join(group.lines)
    finally:
        group.stop()


async def test_workers_serve_when_the_supervisor_is_pid_1(config: Path) -> None:
    """A container's entrypoint is pid 1: each worker took a parent of pid 1 for its
    supervisor gone and stopped itself, and the supervisor gave up after five. A pid
    namespace of its own needs root and util-linux's ``unshare`` (CI has both: without
    them there it fails, not skips)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        reason = "a pid namespace needs root and unshare"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    wrap = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM")
    boxed = Supervised(config, "--workers", "2", wrap=wrap)
    try:
        time.sleep(2.5)  # past the quick deaths' window
        assert len(await pids_seen(boxed.url, 12)) == 2
        assert "died" not in "".join(boxed.lines)
    finally:
        boxed.stop()


@pytest.mark.parametrize("workers", ["2", "1"])
def test_a_port_another_gateway_serves_is_refused_in_one_line(
    two: Supervised, config: Path, workers: str
) -> None:
    # The reserved socket has SO_REUSEPORT: without a probe, a second supervisor of the
    # same user bound beside the first and the kernel split connections between them.
    port = two.url.rsplit(":", 1)[1]
    run = subprocess.run(
        [NEXUS, "serve", "--config", str(config), "--workers", workers, "--port", port],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines()[-1] == (
        f"nexus: cannot serve on 127.0.0.1:{port}: Address already in use"
    ), run.stderr
    assert "Traceback" not in run.stderr


def test_workers_auto_is_one_per_core(config: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    if cores == 1:
        # One core: one worker, served by the process itself (no supervisor, no children).
        proc, _ = start_nexus(config, config.parent / "nexus.log", "--workers", "auto")
        try:
            assert "with 1 workers" not in (config.parent / "nexus.log").read_text()
            out = subprocess.run(
                ["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True
            ).stdout
            assert out.split() == []
        finally:
            stop_nexus(proc)
        return
    server = Supervised(config, "--workers", "auto")
    try:
        assert int(server.wait_for(SERVING).group(2)) == cores
        assert len(server.workers()) == cores
    finally:
        server.stop()


def test_bad_worker_counts_are_refused(config: Path) -> None:
    for value in ("0", "-1", "many"):
        run = subprocess.run(
            [NEXUS, "serve", "--config", str(config), "--workers", value],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert run.returncode == 2
        assert "a number of workers (1 or more) or 'auto'" in run.stderr


def refused_before_any_worker(
    path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``nexus serve --workers 2`` with the config at ``path``: refused, exit 2 (a config
    error checked once, before any worker forks, not in each worker's restart loop)."""
    run = subprocess.run(
        [NEXUS, "serve", "--config", str(path), "--workers", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=20,
        env=env,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    return run


def test_an_unset_metrics_token_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    # Each worker builds its app: checked there alone, every worker would die and be
    # restarted in a loop. Checked once, first, it is a config error.
    path = tmp_path / "config.toml"
    path.write_text('[metrics]\ntoken_env = "NEXUS_TEST_UNSET_METRICS_TOKEN"\n')
    env = {k: v for k, v in os.environ.items() if k != "NEXUS_TEST_UNSET_METRICS_TOKEN"}
    run = refused_before_any_worker(path, env)
    assert (
        f"nexus: config error: {path}: [metrics] token_env: the environment variable it names "
        "is not set"
    ) in run.stderr  # the file named, as every config error names it
    assert "Traceback" not in run.stderr


def test_budgets_with_the_memory_store_are_refused_with_several_workers(tmp_path: Path) -> None:
    """Each worker kept its own spend: a $0.50 budget let four workers spend $1.60."""
    path = tmp_path / "config.toml"
    key = f'[[auth.keys]]\nname = "a"\nsha256 = "{"0" * 64}"\nbudget_usd = 0.5\n'
    path.write_text('[providers.mock]\nkind = "mock"\n\n' + key)
    run = refused_before_any_worker(path)
    assert "budget_usd with several workers needs [store] kind" in run.stderr
    assert "Traceback" not in run.stderr


def test_uvloop_asked_for_and_missing_is_one_line_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    """Checked in each worker alone, it was five tracebacks, a restart loop, then exit 1."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "uvloop.py").write_text('raise ImportError("uvloop is not installed (a stub)")\n')
    path = tmp_path / "config.toml"
    path.write_text('[server]\nuvloop = true\n\n[providers.mock]\nkind = "mock"\n')
    env = {**os.environ, "PYTHONPATH": f"{stub}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = refused_before_any_worker(path, env)
    assert "[server] uvloop: uvloop is not installed" in run.stderr
    assert "Traceback" not in run.stderr


def redis_config(tmp_path: Path, prefix: str) -> Path:
    """The mock provider and the Redis store under ``prefix``."""
    path = tmp_path / "config.toml"
    path.write_text(
        '[providers.mock]\nkind = "mock"\n\n'
        f'[store]\nkind = "redis"\nurl = "{REDIS_URL}"\nprefix = "{prefix}"\n'
    )
    return path


async def test_with_redis_any_worker_resumes_any_stream(tmp_path: Path) -> None:
    """Start streams on whichever worker and attach over fresh connections: with two
    workers about half the attaches land on the other one, and all must resume."""
    client = await connect_or_skip()
    prefix = new_prefix()
    server = Supervised(redis_config(tmp_path, prefix), "--workers", "2")
    try:
        assert len(server.workers()) == 2
        crossed = 0
        for i in range(16):
            text = f"resume {i} across workers"
            async with aiohttp.ClientSession() as http:
                body = chat_body(text, background=True, mock={"delay_ms": 5})
                async with http.post(server.url + CHAT, json=body) as resp:
                    assert resp.status == 202, await resp.text()
                    started = await resp.json()
                maker = await worker_of(http, server.url)
            async with aiohttp.ClientSession() as http:
                async with http.get(server.url + started["url"]) as resp:
                    assert resp.status == 200, await resp.text()
                    attached = await resp.read()
                reader = await worker_of(http, server.url)
            assert b"event: error" not in attached, attached[-600:]
            assert contents(attached) == text
            assert attached.endswith(b"data: [DONE]\n\n")
            crossed += maker != reader
        # The kernel spread the connections: some attaches landed on the other worker.
        # (All 16 on the same one would happen once in ~30,000 runs.)
        assert crossed >= 1
    finally:
        server.stop()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_with_redis_a_live_stream_resumes_mid_stream_on_the_other_worker(
    tmp_path: Path,
) -> None:
    """A client reads part of a stream from one worker, drops, and resumes with its
    Last-Event-ID on a connection that landed on the other worker, while the stream
    still runs on the first: it gets exactly the rest."""
    client = await connect_or_skip()
    prefix = new_prefix()
    server = Supervised(redis_config(tmp_path, prefix), "--workers", "2")
    text = " ".join(f"w{i}" for i in range(40))  # 40 tokens, 50 ms each: 2 s
    try:
        async with aiohttp.ClientSession() as first:
            maker = await worker_of(first, server.url)
            body = chat_body(text, mock={"delay_ms": 50})
            resumable = {"X-Nexus-Resumable": "true"}  # it outlives the dropped connection
            async with first.post(server.url + CHAT, json=body, headers=resumable) as resp:
                assert resp.status == 200, await resp.text()
                stream_id = resp.headers["X-Nexus-Stream-Id"]
                head, last_id = b"", None
                while head.count(b'"content":"') < 4:
                    line = await resp.content.readline()
                    assert line, "the stream ended before its first tokens"
                    head += line
                    if line.startswith(b"id: "):
                        last_id = line[4:].strip().decode()
                while not head.endswith(b"\n\n"):  # the rest of the frame the id is for
                    head += await resp.content.readline()
            assert b"[DONE]" not in head
        # Fresh connections until one lands on the other worker (SO_REUSEPORT spreads
        # them by source port: about half do).
        for _ in range(40):
            async with aiohttp.ClientSession() as other:
                if await worker_of(other, server.url) == maker:
                    continue
                started = time.monotonic()
                headers = {"Last-Event-ID": str(last_id)}
                async with other.get(
                    server.url + f"/v1/streams/{stream_id}", headers=headers
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    first_byte = await resp.content.readline()
                    waited = time.monotonic() - started
                    rest = first_byte + await resp.read()
                break
        else:
            pytest.fail("no connection landed on the other worker in 40 tries")
        assert waited < 1.0  # joined live, not after the stream's end
        assert rest.endswith(b"data: [DONE]\n\n")
        assert (contents(head) + contents(rest)).strip() == text
        assert contents(rest)  # most of the stream was still to come
    finally:
        server.stop()
        await drop_keys(client, prefix)
        await client.aclose()


def test_sigint_stops_cleanly(config: Path) -> None:
    server = Supervised(config, "--workers", "2")
    try:
        workers = server.workers()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(15) == 0
        for pid in workers:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        server.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sighup_stops_gracefully_like_sigterm(
    config: Path, workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGHUP's default ended a lone process at once (its streams cut, nothing charged)
    and the supervisor alone (its metrics directory left behind)."""
    temp = config.parent / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # where the workers' metrics directory goes
    ready = SERVING if workers == "2" else re.compile(r"Nexus serving on (http://\S+)")
    server = Supervised(config, "--workers", workers, ready=ready)
    try:
        workers_before = server.workers() if workers == "2" else set()
        body = orjson.dumps(chat_body("a b c d e f", mock={"delay_ms": 150}))
        curl = subprocess.Popen(
            ["curl", "-sN", server.url + CHAT, "-H", "Content-Type: application/json", "-d", body],
            stdout=subprocess.PIPE,
        )
        time.sleep(0.4)  # the stream is on its way
        server.proc.send_signal(signal.SIGHUP)
        out, _ = curl.communicate(timeout=15)
        assert contents(out) == "a b c d e f"  # finished inside the grace period
        assert server.proc.wait(15) == 0
        for pid in workers_before:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert "stopped" in "".join(server.lines)
        assert list(temp.iterdir()) == []
    finally:
        server.stop()

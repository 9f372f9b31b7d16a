"""``nexus serve`` as a real process: start-up, curl -N pacing, config errors, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import websockets

from support import METRICS_TOKEN_ENV

NEXUS = str(Path(sys.executable).parent / "nexus")
CURL = "curl"


def _start(config: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [NEXUS, "serve", "--config", str(config), "--port", "0", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 20
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(r"Nexus serving on (http://\S+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    proc.stderr.close()
    raise AssertionError("nexus serve did not report its URL:\n" + "".join(seen))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    config = tmp_path / "config.toml"
    config.write_text(
        "[server]\nshutdown_grace_s = 0.5\nheartbeat_interval_s = 15\n\n"
        '[providers.mock]\nkind = "mock"\n'
    )
    proc, url = _start(config)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    assert proc.stderr is not None
    proc.stderr.close()


def _curl(url: str, body: dict[str, object], query: str = "") -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            CURL,
            "-sN",
            url + "/v1/chat/completions" + query,
            "-H",
            "Content-Type: application/json",
            "-d",
            orjson.dumps(body).decode(),
        ],
        stdout=subprocess.PIPE,
        bufsize=0,
    )


def _timed_lines(proc: subprocess.Popen[bytes]) -> list[tuple[float, bytes]]:
    assert proc.stdout is not None
    out = []
    for line in iter(proc.stdout.readline, b""):
        out.append((time.monotonic(), line))
    proc.stdout.close()
    proc.wait(10)
    return out


@pytest.mark.parametrize("fmt", ["sse", "nexus", "ndjson"])
def test_curl_sees_frames_one_by_one(server: tuple[subprocess.Popen[str], str], fmt: str) -> None:
    _, url = server
    body = {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": "one two three four"}],
        "stream": True,
        "mock": {"delay_ms": 250},
    }
    lines = _timed_lines(_curl(url, body, f"?stream_format={fmt}"))
    content = [(t, line) for t, line in lines if b'"one"' in line or b'" four"' in line]
    assert len(content) == 2
    (first_at, _), (last_at, _) = content
    # Three 250 ms gaps separate "one" from "four": they must not arrive together.
    assert last_at - first_at > 0.5


def test_serve_logs_url_and_stops_on_sigterm(server: tuple[subprocess.Popen[str], str]) -> None:
    proc, url = server
    assert url.startswith("http://127.0.0.1:")
    out = subprocess.run(
        [CURL, "-s", url + "/healthz"], capture_output=True, check=True, timeout=10
    ).stdout
    assert orjson.loads(out) == {"status": "ok", "streams": 0, "clients": 0, "pid": proc.pid}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert proc.stderr is not None
    assert "stopped" in proc.stderr.read()


def test_sigterm_ends_running_streams_with_a_retryable_error(
    server: tuple[subprocess.Popen[str], str],
) -> None:
    proc, url = server
    body = {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": "word " * 200}],
        "stream": True,
        "mock": {"delay_ms": 100},
    }
    client = _curl(url, body)
    assert client.stdout is not None
    first = client.stdout.readline()  # the stream is running
    assert first.startswith(b"retry: ")
    proc.send_signal(signal.SIGTERM)
    rest = client.stdout.read()
    client.stdout.close()
    client.wait(10)
    assert proc.wait(15) == 0
    frames = rest.split(b"\n\n")
    assert b"event: error" in rest
    error_frame = next(f for f in frames if b"event: error\n" in f)
    error = orjson.loads(error_frame.split(b"data: ", 1)[1])["error"]
    assert error["code"] == "server_shutting_down"
    assert rest.endswith(b"data: [DONE]\n\n")
    # The grace period let it run a little longer, but not to the end (200 words).
    assert 2 < rest.count(b'"content"') < 150


@pytest.mark.parametrize(
    ("setting", "flags", "loop"),
    [
        ("uvloop = true\n", [], "uvloop"),
        ("", [], "uvloop"),  # the default, "auto": uvloop where it is installed (the test extra)
        ("uvloop = true\n", ["--loop", "asyncio"], "asyncio"),  # the flag wins
        ("uvloop = false\n", ["--loop", "uvloop"], "uvloop"),
    ],
    ids=["configured", "default-auto", "flag-asyncio", "flag-uvloop"],
)
def test_serves_on_the_event_loop_chosen(
    tmp_path: Path, setting: str, flags: list[str], loop: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\n{setting}[providers.mock]\nkind = "mock"\n')
    proc = subprocess.Popen(
        [NEXUS, "serve", "--config", str(config), "--port", "0", *flags],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "serving on" in line:
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    proc.stderr.close()
    assert any(f"event loop: {loop}" in line for line in lines), lines


def test_sigterm_closes_realtime_sockets_with_1001(
    server: tuple[subprocess.Popen[str], str],
) -> None:
    proc, url = server

    async def scenario() -> int | None:
        async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
            request = {
                "model": "mock/echo",
                "messages": [{"role": "user", "content": "word " * 100}],
                "mock": {"delay_ms": 100},
            }
            await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
            await ws.recv()
            proc.send_signal(signal.SIGTERM)
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            except websockets.ConnectionClosed:
                pass
            return ws.close_code

    assert asyncio.run(scenario()) == 1001
    assert proc.wait(15) == 0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[server]\nheartbeat_intervl_s = 3\n", "[server] heartbeat_intervl_s: unknown key"),
        ("[server]\nport = 99999\n", "[server] port: Input should be less than or equal to 65535"),
        ('[providers.x]\nkind = "mock"\n[models.fast]\ntargets = ["y/z"]\n', "'y/z'"),
        ("[caches]\nenabled = true\n", "[caches]: unknown table or key"),
        ('[store]\nkind = "memcached"\n', "[store] kind: unknown kind 'memcached'"),
        ("[server\n", "not valid TOML"),
        ("[server]\nbacklog = 2147483648\n", "[server] backlog: Input should be less than"),
        ('[server]\nuvloop = "yes"\n', '[server] uvloop: expected true, false or "auto"'),
    ],
)
def test_config_errors_name_file_and_key(tmp_path: Path, text: str, fragment: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    done = subprocess.run(
        [NEXUS, "serve", "--config", str(config)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"nexus: config error: {config}: ")
    assert fragment in done.stderr
    assert done.stderr.count("\n") == 1  # one line, no traceback


def test_missing_config_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [NEXUS, "serve", "--config", str(tmp_path / "nope.toml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "nope.toml" in done.stderr
    assert "cannot read" in done.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_missing_provider_key_names_the_config_key(tmp_path: Path, workers: str) -> None:
    """In one line, exit 2, with workers too: checked before any worker forks (each
    worker failed on it and was restarted, five tracebacks, after "serving", exit 1)."""
    config = tmp_path / "config.toml"
    config.write_text(
        '[providers.openai]\nkind = "openai"\napi_key_env = "NEXUS_TEST_UNSET_KEY_VAR"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "NEXUS_TEST_UNSET_KEY_VAR"}
    done = subprocess.run(
        [NEXUS, "serve", "--config", str(config), "--port", "0", "--workers", workers],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 2
    assert f"nexus: config error: {config}: [providers.openai] api_key_env" in done.stderr
    assert "the environment variable it names is not set" in done.stderr
    assert "NEXUS_TEST_UNSET_KEY_VAR" not in done.stderr  # it may be a key put there
    assert "Traceback" not in done.stderr and "serving" not in done.stderr
    assert done.stderr.count("config error") == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "code", "said"),
    [
        # Unreachable: the message was "cannot serve on 127.0.0.1:8080: None".
        # (A port nobody listens on, found as the test runs: a collection-time value would
        # differ between the processes of a parallel run.)
        ("redis://:s3cret-pw-0042@127.0.0.1:{free}/0", 1, "nexus: cannot start: Redis"),
        # Malformed: a ValueError traceback from the client's URL parser.
        ("redis://:s3cret-pw-0042@host:notaport/0", 2, "[store] url: not a Redis URL"),
        ("redis://:s3cret-pw-0042@h/0?socket_timeout=abc", 2, "'socket_timeout'"),
    ],
)
def test_a_store_that_cannot_be_used_is_one_line_without_its_password(
    tmp_path: Path, url: str, code: int, said: str
) -> None:
    config = tmp_path / "config.toml"
    url = url.replace("{free}", str(_free_port()))
    config.write_text(f'[store]\nkind = "redis"\nurl = "{url}"\n')
    done = subprocess.run(
        [NEXUS, "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == code, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("nexus:")]
    assert len(errors) == 1 and said in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "None" not in done.stderr
    assert "s3cret-pw-0042" not in done.stderr


def test_an_unreachable_redis_is_one_line_before_any_worker_starts(tmp_path: Path) -> None:
    # Each worker failed on it, was restarted and failed again, after "Nexus serving on".
    config = tmp_path / "config.toml"
    url = f"redis://:s3cret-pw-0042@127.0.0.1:{_free_port()}/0"
    config.write_text(f'[store]\nkind = "redis"\nurl = "{url}"\n')
    done = subprocess.run(
        [NEXUS, "serve", "--config", str(config), "--port", "0", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("nexus: cannot start: Redis not reachable at redis://127.0.0.1:")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "s3cret-pw-0042" not in done.stderr


@pytest.mark.parametrize(
    ("config", "warned"),
    [
        ('[[auth.keys]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\n', True),
        ('[auth]\nallow_unauthenticated = true\n[server]\nhost = "0.0.0.0"\n', True),
        ('[server]\nhost = "127.0.0.1"\n', False),  # keyless: this machine, by its names
        (
            '[[auth.keys]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\n'
            f'[metrics]\ntoken_env = "{METRICS_TOKEN_ENV}"\n',
            False,
        ),
    ],
    ids=["keys", "allow-unauthenticated", "keyless", "token"],
)
@pytest.mark.usefixtures("metrics_token")
def test_a_gateway_serving_others_without_a_metrics_token_says_metrics_are_closed(
    tmp_path: Path, config: str, warned: bool
) -> None:
    """With keys (or allow_unauthenticated) /metrics answers its bearer token only: a
    same-host reverse proxy makes every client look local. Without [metrics] token_env
    it is closed, and the start says so, once, even with several workers."""
    from nexus_process import start_nexus, stop_nexus

    path = tmp_path / "config.toml"
    path.write_text(config)
    proc, _ = start_nexus(path, tmp_path / "nexus.log", "--workers", "2")
    stop_nexus(proc)
    log = (tmp_path / "nexus.log").read_text()
    assert log.count("/metrics answers 403 to every client until [metrics] token_env") == warned

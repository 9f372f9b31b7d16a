"""What an idle stream holds, by the line that allocated it: ``tracemalloc`` in the gateway.

The idle scenario measures RSS per stream; this says where it goes. It starts the bench's
upstream (one token a second) and a gateway (``nexus serve`` with the bench's config, or
the raw proxy) under ``tracemalloc``, warms the gateway up with short streams, takes a
snapshot, opens ``--streams`` streams that each read their first bytes and stay open, takes
a second snapshot, and prints the difference per stream: by file, then by allocating line
with its callers. Python's allocations only (not the kernel's socket buffers, nor C
libraries' own), so the total is a little under the RSS figure, for the raw proxy alike.

Run: ``python -m bench.memory [--system nexus|nexus-redis|rawproxy] [--streams 1000] [--ws]``
(``nexus-redis`` needs Redis at ``$NEXUS_BENCH_REDIS_URL``, default 127.0.0.1:6379).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import aiohttp

from .systems import ROOT, _nexus_config, free_port

__all__ = ["main"]

CHAT = "/v1/chat/completions"
REALTIME = "/v1/realtime"


def _serve(argv: list[str], snapshots: Path) -> None:
    """The gateway's process: ``tracemalloc`` on, a snapshot on each SIGUSR1."""
    tracemalloc.start(int(os.environ.get("NEXUS_BENCH_FRAMES", "8")))
    taken = [0]

    def snapshot(signum: int, frame: object) -> None:
        tracemalloc.take_snapshot().dump(str(snapshots / f"{taken[0]}.snap"))
        taken[0] += 1
        print("SNAPSHOT", flush=True)

    signal.signal(signal.SIGUSR1, snapshot)
    if argv[0] == "rawproxy":
        from . import rawproxy

        sys.argv = ["rawproxy", *argv[1:]]
        rawproxy.main()
    else:
        from nexus.cli import main as nexus_main

        sys.exit(nexus_main(argv))


async def _open(url: str, count: int, opened: asyncio.Event | None, ws: bool = False) -> None:
    """``count`` streams (realtime turns with ``ws``) that read their first bytes, then stay
    open until cancelled."""
    body = {"model": "bench/m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    started = 0

    def first() -> None:
        nonlocal started
        started += 1
        if opened is not None and started == count:
            opened.set()

    async def one(session: aiohttp.ClientSession) -> None:
        if ws:
            async with session.ws_connect(url.replace("http", "ws", 1) + REALTIME) as socket:
                await socket.send_json({"type": "start", "request": body})
                await socket.receive()
                first()
                async for message in socket:
                    if message.type is aiohttp.WSMsgType.TEXT and '"type":"done"' in message.data:
                        return
            return
        async with session.post(url + CHAT, json=body) as response:
            assert response.status == 200, await response.text()
            await response.content.readany()
            first()
            async for _ in response.content.iter_any():
                pass

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session) for _ in range(count)))


def _configure(port: int, chunks: int, delay_ms: float) -> None:
    import urllib.request

    data = f'{{"chunks": {chunks}, "delay_ms": {delay_ms}}}'.encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/_bench/config", data=data, method="POST"
    )
    urllib.request.urlopen(request).read()


def _start_gateway(system: str, base: str, port: int, work: Path) -> subprocess.Popen[str]:
    if system == "rawproxy":
        argv = ["rawproxy", "--upstream", base, "--port", str(port)]
    else:
        redis = os.environ.get("NEXUS_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
        store = redis if system == "nexus-redis" else None
        config = work / "nexus.toml"
        config.write_text(_nexus_config("nexus", base, port, store, f"memory-{port}"))
        argv = ["serve", "--config", str(config)]
    return subprocess.Popen(
        [sys.executable, "-m", "bench.memory", "--serve", str(work), *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def _ready(gateway: subprocess.Popen[str], url: str, system: str) -> bool:
    """The gateway answers on ``url`` (its own health path, 200): False once it exited."""
    import urllib.error
    import urllib.request

    path = "/_bench/stats" if system == "rawproxy" else "/healthz"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and gateway.poll() is None:
        try:
            with urllib.request.urlopen(url + path, timeout=2) as response:
                if response.status == 200:
                    return gateway.poll() is None
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    return False


def _report(before: Path, after: Path, streams: int, top: int) -> None:
    old, new = tracemalloc.Snapshot.load(str(before)), tracemalloc.Snapshot.load(str(after))
    by_file = new.compare_to(old, "filename")
    print(f"\n{sum(s.size_diff for s in by_file) / streams:,.0f} bytes a stream in all\n")
    print("by file (bytes, allocations a stream):")
    for stat in by_file[:top]:
        where = stat.traceback[0].filename
        print(f"  {stat.size_diff / streams:7,.0f} {stat.count_diff / streams:6.2f}  {where}")
    print("\nby allocating line, with its callers:")
    for stat in new.compare_to(old, "traceback")[:top]:
        frames = " < ".join(
            f"{Path(f.filename).name}:{f.lineno}" for f in reversed(stat.traceback[-5:])
        )
        print(f"  {stat.size_diff / streams:7,.0f} {stat.count_diff / streams:6.2f}  {frames}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        _serve(sys.argv[3:], Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("nexus", "nexus-redis", "rawproxy"), default="nexus")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--ws", action="store_true", help="realtime turns, not HTTP streams")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nexus-bench-memory-"))
    # As for the gateway below: a port free_port() found may be taken before the upstream
    # binds it (it then exits without READY), so another is tried.
    for _ in range(5):
        up_port = free_port()
        upstream = subprocess.Popen(
            [sys.executable, "-m", "bench.upstream", "--port", str(up_port)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert upstream.stdout is not None
        if upstream.stdout.readline().startswith("READY"):
            break
        upstream.wait()
    else:
        raise SystemExit("the bench upstream did not start on any of five ports")
    base = f"http://127.0.0.1:{up_port}"
    gateway: subprocess.Popen[str] | None = None
    try:
        # A port free_port() found may be taken before the gateway binds it (another
        # process's server on port 0): then the gateway exits, and this tries another.
        for _ in range(5):
            port = free_port()
            gateway = _start_gateway(args.system, base, port, work)
            url = f"http://127.0.0.1:{port}"
            if _ready(gateway, url, args.system):
                break
            gateway.kill()
            gateway.wait()
        else:
            raise RuntimeError("the gateway did not start on any of five ports")
        _configure(up_port, 3, 5)
        asyncio.run(_open(url, 50, None))  # warm-up: 50 short streams
        _configure(up_port, 60, 1000)

        def snapshot() -> None:
            gateway.send_signal(signal.SIGUSR1)
            assert gateway.stdout is not None
            while not gateway.stdout.readline().startswith("SNAPSHOT"):
                pass

        snapshot()

        async def hold() -> None:
            opened = asyncio.Event()
            streams = asyncio.ensure_future(_open(url, args.streams, opened, args.ws))
            await opened.wait()
            await asyncio.sleep(2)  # every stream past its first bytes, then idle
            await asyncio.get_running_loop().run_in_executor(None, snapshot)
            streams.cancel()

        asyncio.run(hold())
    finally:
        for process in (gateway, upstream):
            if process is not None:
                process.kill()
                process.wait()
    try:
        _report(work / "0.snap", work / "1.snap", args.streams, args.top)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The systems under test, and how each is started, pinned, measured and stopped.

==================  ===============================================================  ======
system              what runs                                                        format
==================  ===============================================================  ======
direct              nothing: the load generator talks to the fake upstream           sse
rawproxy            ``python -m bench.rawproxy`` (bytes copied, nothing parsed)      sse
nexus               ``nexus serve`` with an openai-kind provider on the upstream     each
nexus-w2            the same with ``--workers 2``                                    sse
nexus-asyncio       the same on asyncio's own loop (``[server] uvloop = false``;     sse
                    opt-in: the default picks uvloop where it is installed)
nexus-w4            the same with ``--workers 4`` (opt-in)                           sse
nexus-redis         the same with ``[store] kind = "redis"``, on a ``redis-server``  sse
                    of the run's own (:class:`RedisServer`)
nexus-redis-w2      ``nexus-redis`` with ``--workers 2`` (opt-in, as the next two)   sse
nexus-redis-w4      ``nexus-redis`` with ``--workers 4``                             sse
nexus-redis-2p      two ``nexus-redis`` processes on two ports, one key prefix: the  sse
                    load generator sends every other stream to the second
nexus-anthropic-up  the same with an anthropic-kind provider: Anthropic's frames     sse
                    in (``POST /v1/messages``), OpenAI SSE out
litellm             the LiteLLM proxy from ``bench/litellm`` (when installed)        sse
==================  ===============================================================  ======

A *variant* is a system and the output format its clients ask for; each Nexus format
is a variant of its own (one row in the tables). Every variant runs in a fresh
process, started before the round and measured alone.

Nexus gets the settings a deployment of this size needs and nothing else: a provider
pool and a stream limit large enough for 5,000 streams (a stream holds a pooled upstream
connection for its length), and no access log, like the peer (LiteLLM logs at ERROR)
and the raw proxy (none).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from .procfs import pin, tree

__all__ = [
    "FORMAT_LABELS",
    "REDIS_SYSTEMS",
    "SCALEOUT_SYSTEMS",
    "Pinning",
    "RedisServer",
    "Running",
    "StartError",
    "Variant",
    "litellm_module",
    "plan_pinning",
    "start",
]

ROOT = Path(__file__).resolve().parent.parent
CHAT_PATH = "/v1/chat/completions"
FORMAT_LABELS = {
    "sse": "openai-sse",
    "nexus": "native-sse",
    "ndjson": "ndjson",
    "anthropic": "anthropic-sse",
    "responses": "responses-sse",
    "ws": "websocket",
}
REDIS_SYSTEMS = ("nexus-redis", "nexus-redis-w2", "nexus-redis-w4", "nexus-redis-2p")
"""On the Redis store; Redis's CPU is measured apart for each."""
WORKERS = {"nexus-w2": 2, "nexus-w4": 4, "nexus-redis-w2": 2, "nexus-redis-w4": 4}
"""``nexus serve --workers N``: one port, the kernel spreads the connections (SO_REUSEPORT)."""
PROCESSES = {"nexus-redis-2p": 2}
"""Separate ``nexus serve`` processes, each on its own port, sharing one Redis."""
NEXUS_SYSTEMS = (
    "nexus",
    "nexus-w2",
    "nexus-w4",
    "nexus-asyncio",
    *REDIS_SYSTEMS,
    "nexus-anthropic-up",
)
SYSTEMS = ("direct", "rawproxy", *NEXUS_SYSTEMS, "litellm")
SCALEOUT_SYSTEMS = ("nexus", "nexus-w2", "nexus-w4", *REDIS_SYSTEMS)
"""What the ``scaleout`` scenario runs (OpenAI SSE), each against its one-worker twin."""


@dataclass(frozen=True)
class Variant:
    system: str
    format: str = "sse"

    @property
    def label(self) -> str:
        if self.system in NEXUS_SYSTEMS:
            return f"{self.system} ({FORMAT_LABELS[self.format]})"
        return self.system

    @property
    def multi_process(self) -> bool:
        return self.system in WORKERS or self.system in PROCESSES


@dataclass(frozen=True)
class Pinning:
    """Which CPUs each side gets (None: not pinned)."""

    load: set[int] | None
    upstream: set[int] | None
    gateway: set[int] | None
    multi: set[int] | None
    note: str


def plan_pinning(cpus: list[int]) -> Pinning:
    """Gateway and load side on different cores where the machine has them.

    Two CPUs: the gateway on the second, the load generator, the upstream and the
    harness on the first; a multi-worker gateway is left on both (pinning its
    workers to one core would measure nothing). Four or more: the upstream gets a
    core of its own and a gateway of several processes every core from the gateway's up.
    """
    if len(cpus) < 2:
        return Pinning(None, None, None, None, "one CPU: nothing pinned")
    c = cpus
    if len(c) == 2:
        return Pinning(
            {c[0]},
            {c[0]},
            {c[1]},
            None,
            f"gateway on CPU {c[1]}; load generator, upstream and harness on CPU {c[0]}; "
            "multi-worker gateways unpinned (both CPUs, shared with the load side)",
        )
    if len(c) == 3:
        return Pinning(
            {c[0]},
            {c[0]},
            {c[1]},
            {c[1], c[2]},
            f"gateway on CPU {c[1]} (multi-worker: CPUs {c[1]},{c[2]}); "
            f"load generator, upstream and harness on CPU {c[0]}",
        )
    return Pinning(
        {c[0]},
        {c[1]},
        {c[2]},
        set(c[2:]),
        f"load generator and harness on CPU {c[0]}, upstream on CPU {c[1]}, gateway on "
        f"CPU {c[2]} (multi-worker: CPUs {','.join(map(str, c[2:]))})",
    )


class StartError(RuntimeError):
    """A system did not come up; the message ends with the tail of its log."""


@dataclass
class Running:
    """A system under test: where to send requests, and its process (None for direct).
    ``peers``: the other processes of a system of several (``nexus-redis-2p``), each with
    its own port; :attr:`urls` lists them all, and the load generator spreads the streams."""

    variant: Variant
    base_url: str
    model: str
    api_key: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    ready_path: str = "/"
    started_at: float = field(default_factory=time.monotonic)
    peers: list[Running] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.base_url + CHAT_PATH

    @property
    def urls(self) -> list[str]:
        return [self.url, *(peer.url for peer in self.peers)]

    def pids(self) -> list[int]:
        """Every process of the system: each process's tree (a supervisor and its workers)."""
        mine = [] if self.proc is None or self.proc.poll() is not None else tree(self.proc.pid)
        return mine + [pid for peer in self.peers for pid in peer.pids()]

    def event_loop(self) -> str | None:
        """The event loop the system says it runs on (``event loop: uvloop`` in its log)."""
        if self.log is None or not self.log.exists():
            return None
        found = re.search(r"event loop: (\w+)", self.log.read_text(errors="replace"))
        return found[1] if found else None

    def log_tail(self, lines: int = 15) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float) -> None:
        """Poll ``ready_path`` until it answers 200; :class:`StartError` if the process
        exits or the time runs out."""
        for peer in self.peers:
            peer.wait_ready(timeout)
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                last = tail.splitlines()[-1] if tail else ""
                raise StartError(f"exited with {self.proc.returncode} at start: {last}\n" + tail)
            url = self.base_url + self.ready_path
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.05)
        raise StartError(f"not ready after {timeout:.0f}s\n" + self.log_tail())

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM (a supervisor passes it to its workers), then SIGKILL to what is left."""
        for peer in self.peers:
            peer.stop(grace)
        if self.proc is None or self.proc.poll() is not None:
            return
        pids = tree(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        for pid in pids[1:]:  # workers that outlived their supervisor
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def litellm_module() -> ModuleType | None:
    """``bench/litellm/system.py`` (another part of the harness), if it is there."""
    try:
        return importlib.import_module("bench.litellm.system")
    except ImportError:
        return None


def _nexus_config(system: str, upstream: str, port: int, redis_url: str | None, prefix: str) -> str:
    loop = "uvloop = false\n" if system == "nexus-asyncio" else ""
    store = ""
    if redis_url is not None:
        store = f'[store]\nkind = "redis"\nurl = "{redis_url}"\nprefix = "{prefix}"\n'
    provider = f'kind = "openai"\nbase_url = "{upstream}/v1"'
    if system == "nexus-anthropic-up":
        provider = f'kind = "anthropic"\nbase_url = "{upstream}"'
    return f"""\
# Written by bench/systems.py for one benchmark run.
[server]
host = "127.0.0.1"
port = {port}
{loop}
[limits]
max_concurrent_streams = 1000000

[logging]
access_log = false
{store}
[providers.bench]
{provider}
"""


class RedisServer:
    """The Redis of ``nexus-redis``: a ``redis-server`` of the run's own, on a free port, with
    nothing saved to disk, so that runs are isolated; or, without ``redis-server`` on the
    ``PATH``, the one ``$NEXUS_BENCH_REDIS_URL`` names (then not measured)."""

    def __init__(self, workdir: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = os.environ.get("NEXUS_BENCH_REDIS_URL")
        self.error = ""
        exe = shutil.which("redis-server")
        if exe is None:
            if self.url is None:
                self.error = "redis-server is not on the PATH (or set NEXUS_BENCH_REDIS_URL)"
            return
        port = free_port()
        argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        self.proc = subprocess.Popen(
            [*argv, "no", "--dir", str(workdir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return
            time.sleep(0.02)
        self.error = f"redis-server did not start on port {port}"

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def child_env() -> dict[str, str]:
    """The environment of the harness, with the repository importable as ``bench``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start(
    variant: Variant, upstream: str, workdir: Path, redis: RedisServer | None = None
) -> Running:
    """Start ``variant``'s processes (not waiting for them); see :meth:`Running.wait_ready`.
    ``redis``: the store of the ``nexus-redis*`` systems."""
    system = variant.system
    if system == "direct":
        return Running(variant, upstream, "bench", "sk-bench")
    if system in NEXUS_SYSTEMS:
        return _start_nexus(variant, upstream, workdir, redis)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = variant.label.replace(" ", "_").replace("(", "").replace(")", "")
    log = workdir / f"{name}-{port}.log"
    env = child_env()
    if system == "rawproxy":
        argv = [sys.executable, "-m", "bench.rawproxy", "--upstream", upstream, "--port", str(port)]
        running = Running(variant, base, "bench", "sk-bench", ready_path="/_bench/stats")
    elif system == "litellm":
        module = litellm_module()
        if module is None:
            raise StartError("litellm: bench/litellm/system.py is missing")
        argv, env = module.litellm_command(upstream + "/v1", port, workdir)
        running = Running(
            variant,
            base,
            getattr(module, "MODEL", "bench"),
            getattr(module, "API_KEY", "sk-bench"),
            ready_path=getattr(module, "READY_PATH", "/health/liveliness"),
        )
    else:
        raise StartError(f"unknown system {system!r}")
    return _launch(running, argv, env, workdir, log)


def _start_nexus(
    variant: Variant, upstream: str, workdir: Path, redis: RedisServer | None
) -> Running:
    system = variant.system
    redis_url = None
    if system in REDIS_SYSTEMS:
        if redis is None or redis.error or redis.url is None:
            raise StartError(f"{system}: {redis.error if redis else 'no Redis'}")
        redis_url = redis.url
    ports: set[int] = set()
    while len(ports) < PROCESSES.get(system, 1):
        ports.add(free_port())
    # One key prefix per system under test: its processes share it (a stream started on one
    # resumes on the other), and runs that share one Redis never see each other's streams.
    prefix = f"bench{min(ports)}"
    name = variant.label.replace(" ", "_").replace("(", "").replace(")", "")
    started = []
    for port in sorted(ports):
        config = workdir / f"{name}-{port}.toml"
        config.write_text(_nexus_config(system, upstream, port, redis_url, prefix))
        argv = [sys.executable, "-m", "nexus.cli", "serve", "--config", str(config)]
        if system in WORKERS:
            argv += ["--workers", str(WORKERS[system])]
        base = f"http://127.0.0.1:{port}"
        running = Running(variant, base, "bench/bench", "sk-bench", ready_path="/healthz")
        started.append(_launch(running, argv, child_env(), workdir, workdir / f"{name}-{port}.log"))
    first, *others = started
    first.peers = others
    return first


def _launch(
    running: Running, argv: list[str], env: dict[str, str], workdir: Path, log: Path
) -> Running:
    with log.open("wb") as out:
        running.proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running.log = log
    return running


def pin_running(running: Running, pinning: Pinning) -> None:
    cpus = pinning.multi if running.variant.multi_process else pinning.gateway
    pin(running.pids(), cpus)

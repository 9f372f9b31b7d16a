"""Several worker processes on one port: ``nexus serve --workers N``.

The supervisor forks N workers, each a whole gateway with its own event loop, on the
same port with ``SO_REUSEPORT`` (the kernel spreads connections). It serves nothing
itself: it keeps the port reserved (bound, not listening), restarts a worker that
dies, and on SIGTERM, SIGINT or SIGHUP passes SIGTERM on and waits for the workers to stop
(:mod:`nexus.server.shutdown`); a second signal passes :data:`HURRY_SIGNAL` on. A worker
counts no repeats itself: a signal to the whole process group (Ctrl-C, systemd's
``control-group`` kill) reaches it twice, from the kernel and from its supervisor.
Workers share no memory (the in-memory store is per worker; Redis is shared) but do share
the read tokens' secret (:func:`shared_token_secret`), so a token one worker issued is
good on any other.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, MutableMapping
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from .config import Config
from .tokens import new_secret, secret_from_env

__all__ = [
    "CONFIG_ERROR",
    "HURRY_SIGNAL",
    "STOP_SIGNALS",
    "STORE_UNREACHABLE",
    "Supervisor",
    "cpu_count",
    "reserve_port",
    "shared_token_secret",
]

log = logging.getLogger("nexus")

QUICK_DEATH_S = 2.0
MAX_QUICK_DEATHS = 5
"""Workers dying within :data:`QUICK_DEATH_S` of their start this many times in a row:
the supervisor gives up, as restarting would only spin."""
CONFIG_ERROR = 2
"""The exit code of a config error, a worker's included (its supervisor then stops)."""
STORE_UNREACHABLE = 3
"""A worker's exit code for a store it could not reach at its start: restarted, backing
off, however often (a Redis outage ends; the other workers serve on meanwhile)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What stops the gateway gracefully (a worker, or the supervisor and its workers)."""
HURRY_SIGNAL = signal.SIGUSR2
"""The supervisor's second stop to its workers: no more drain delay nor grace."""
MAX_BACKOFF_S = 30.0
KILL_AFTER_S = 10.0
"""How long past its own bound (``drain_delay_s + shutdown_grace_s +``
:data:`~nexus.server.shutdown.CLOSE_BOUND_S`) a worker may take to stop before it is
killed."""

WorkerMain = Callable[[Config, str, int, Callable[[], None]], int]
"""Runs one worker: ``(config, config source, worker index, ready) -> exit code``; it
calls ``ready()`` once it accepts connections."""
READY_TIMEOUT_S = 60.0
"""How long the supervisor waits for the workers to listen before it says it serves."""


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask, not the machine's)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``, never listening (so no
    connection waits on it): it resolves port 0 and holds the port while workers come
    and go.

    A probe without ``SO_REUSEPORT`` binds first, so a port another process holds is
    ``EADDRINUSE`` here: with the option alone, a second ``nexus serve --workers N`` of
    the same user would share the port with the first and split its connections."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        address = (address[0], probe.getsockname()[1], *address[2:])  # port 0 resolved
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def shared_token_secret(
    config: Config, environ: MutableMapping[str, str] | None = None
) -> Iterator[None]:
    """While in the block, ``[auth] token_secret_env`` names a secret in ``environ``
    (``os.environ``): the configured one, else one made here for the workers forked in
    the block. Raises :class:`~nexus.errors.ConfigError` for a short one."""
    env = os.environ if environ is None else environ
    name = config.auth.token_secret_env
    if secret_from_env(name, env) is not None:
        yield
        return
    previous = env.get(name)
    env[name] = new_secret()
    if config.auth.keys and config.store.kind == "redis":
        log.warning(
            "read tokens are signed with a secret made by this supervisor: its workers "
            "share it, other replicas do not; set %s to one secret (32+ characters) on "
            "every replica sharing the store",
            name,
        )
    try:
        yield
    finally:
        if previous is None:
            env.pop(name, None)
        else:
            env[name] = previous


class Supervisor:
    """Starts, watches and stops the worker processes. See the module docstring."""

    def __init__(self, config: Config, source: str, workers: int, worker_main: WorkerMain) -> None:
        self.config = config
        self.source = source
        self.workers = workers
        self.worker_main = worker_main
        self._context = multiprocessing.get_context("fork")
        self._running: dict[int, tuple[BaseProcess, float]] = {}  # index -> (process, started)
        self._ready: dict[int, Any] = {}  # index -> its multiprocessing.Event
        self._stopping = False
        self.metrics_dir: str | None = None

    def run(self) -> int:
        with shared_token_secret(self.config):
            return self._run()

    def _run(self) -> int:
        server = self.config.server
        reserved = reserve_port(server.host, server.port)
        port = reserved.getsockname()[1]
        config = self.config.model_copy(update={"server": server.model_copy(update={"port": port})})
        if config.metrics.enabled:
            self.metrics_dir = tempfile.mkdtemp(prefix="nexus-metrics-")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        code, killed = 1, False
        try:
            for index in range(self.workers):
                self._start(config, index)
            if self._wait_ready():  # said only once it is true
                shown = f"[{server.host}]" if ":" in server.host else server.host
                log.info(
                    "Nexus serving on http://%s:%d with %d workers (config: %s)",
                    shown,
                    port,
                    self.workers,
                    self.source,
                )
            if self.workers > 1 and config.store.kind == "memory":
                log.warning(
                    "%d workers share no memory: with the in-memory store, resuming a "
                    "stream (and the stream cache) needs sticky routing, and each worker "
                    "counts every key's rate and streams alone (together, once per worker); "
                    '[store] kind = "redis" shares both',
                    self.workers,
                )
            code = self._watch(config)
        finally:
            try:
                killed = self._stop_all(config)  # (a second signal meanwhile hurries them)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            reserved.close()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
        # A worker killed did not close: spend it had not charged is lost. Not a clean stop.
        return code or (1 if killed else 0)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._stopping:
            log.warning("supervisor: %s again, the workers stop now (no grace)", name)
            self._tell_workers(HURRY_SIGNAL)
            return
        log.info("supervisor: %s, stopping the workers", name)
        self._stopping = True
        self._tell_workers(signal.SIGTERM)

    def _tell_workers(self, signum: int) -> None:
        for process, _ in self._running.values():
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    def _start(self, config: Config, index: int) -> None:
        ready = self._context.Event()
        process = self._context.Process(
            target=_worker,
            args=(
                self.worker_main,
                config,
                self.source,
                index,
                self.metrics_dir,
                ready,
                os.getpid(),
            ),
            name=f"nexus-worker-{index}",
            daemon=False,
        )
        process.start()
        self._running[index] = (process, time.monotonic())
        self._ready[index] = ready
        log.debug("worker %d started (pid %s)", index, process.pid)

    def _wait_ready(self) -> bool:
        """Until every worker listens: True; False if one died first (the watch loop
        handles that) or is not listening in time."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for index, ready in list(self._ready.items()):
            process, _ = self._running[index]
            while not ready.wait(0.05):
                if not process.is_alive() or self._stopping:
                    return False
                if time.monotonic() > deadline:
                    log.warning("worker %d is not listening after %.0fs", index, READY_TIMEOUT_S)
                    return False
        return True

    def _watch(self, config: Config) -> int:
        """Until a stop: restart the workers that die; give up on a config error, or on
        workers that keep dying at their start (a store unreachable excepted)."""
        quick_deaths = unreachable = 0
        last_unreachable = 0.0  # (an outage long over starts the backoff afresh)
        due: dict[int, float] = {}  # index -> when to start it again (its store unreachable)
        while (self._running or due) and not self._stopping:
            now = time.monotonic()
            for index, at in list(due.items()):
                if at <= now:
                    del due[index]
                    self._start(config, index)
            sentinels = {process.sentinel: index for index, (process, _) in self._running.items()}
            timeout = max(min([0.5, *(at - now for at in due.values())]), 0.0)
            if not sentinels:
                time.sleep(timeout)
            for sentinel in wait(list(sentinels), timeout) if sentinels else ():
                index = sentinels[sentinel]  # type: ignore[index]
                process, started = self._running.pop(index)
                process.join()
                self._forget(process)
                if self._stopping:
                    log.info("worker %d (pid %s) stopped", index, process.pid)
                    continue
                if process.exitcode == CONFIG_ERROR:  # its one line is above: no retry helps
                    log.error("worker %d stopped on a config error: stopping", index)
                    return CONFIG_ERROR
                if process.exitcode == STORE_UNREACHABLE:  # its line says why: wait, again
                    if time.monotonic() - last_unreachable > 2 * MAX_BACKOFF_S:
                        unreachable = 0
                    unreachable, last_unreachable = unreachable + 1, time.monotonic()
                    wait_s = min(0.5 * 2**unreachable, MAX_BACKOFF_S)
                    log.error(
                        "worker %d cannot reach the store: starting it again in %.1fs",
                        index,
                        wait_s,
                    )
                    due[index] = time.monotonic() + wait_s
                    continue
                unreachable = 0
                lived = time.monotonic() - started
                log.error(
                    "worker %d (pid %s) died (%s) after %.1fs; restarting it",
                    index,
                    process.pid,
                    _how_it_ended(process.exitcode),
                    lived,
                )
                quick_deaths = quick_deaths + 1 if lived < QUICK_DEATH_S else 0
                if quick_deaths >= MAX_QUICK_DEATHS:
                    log.error(
                        "%d workers in a row died within %.0fs of their start: giving up",
                        quick_deaths,
                        QUICK_DEATH_S,
                    )
                    return 1
                if quick_deaths:
                    time.sleep(min(0.1 * 2**quick_deaths, QUICK_DEATH_S))
                if self._stopping:  # a signal came during the sleep: start nothing more
                    continue
                self._start(config, index)
        return 0

    def _stop_all(self, config: Config) -> bool:
        """SIGTERM to every worker left, then wait; kill those past grace + a margin
        (True: one was)."""
        killed = False
        if self._running and not self._stopping:
            self._stopping = True
            self._tell_workers(signal.SIGTERM)
        from .server.shutdown import CLOSE_BOUND_S

        server = config.server
        bound = server.drain_delay_s + server.shutdown_grace_s + CLOSE_BOUND_S
        deadline = time.monotonic() + bound + KILL_AFTER_S
        for index, (process, _) in list(self._running.items()):
            process.join(max(deadline - time.monotonic(), 0))
            if process.is_alive():
                log.error("worker %d (pid %s) did not stop: killing it", index, process.pid)
                process.kill()
                process.join()
                killed = True
            else:
                log.info("worker %d (pid %s) stopped", index, process.pid)
            self._forget(process)
        self._running.clear()
        return killed

    def _forget(self, process: BaseProcess) -> None:
        """Drop a dead worker's live gauges from the shared metrics."""
        if self.metrics_dir is not None and process.pid is not None:
            from .server.metrics import mark_worker_dead

            mark_worker_dead(self.metrics_dir, process.pid)


def _how_it_ended(exitcode: int | None) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` (multiprocessing's -9)."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _worker(
    worker_main: WorkerMain,
    config: Config,
    source: str,
    index: int,
    metrics_dir: str | None,
    ready: Any,
    supervisor: int,
) -> None:
    """A worker's first steps after the fork, then its gateway."""
    # The supervisor's handlers came along with the fork; the worker's loop sets its own.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(HURRY_SIGNAL, signal.SIG_IGN)  # until its loop's handler: never a kill
    _die_with_parent(supervisor)
    if metrics_dir is not None:
        from .server.metrics import enable_multiprocess

        enable_multiprocess(metrics_dir)
    raise SystemExit(worker_main(config, source, index, ready.set))


def _die_with_parent(supervisor: int) -> None:
    """Linux: SIGTERM this worker if the supervisor dies (even by SIGKILL). Its pid, not
    1: in a container the supervisor may be pid 1 itself."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != supervisor:  # the supervisor died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)

"""The supervisor in this process: what it does between a worker's death and its restart."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from nexus import supervisor
from nexus.config import Config, ServerConfig
from nexus.server import shutdown
from nexus.supervisor import Supervisor


def test_a_signal_during_the_restart_backoff_starts_no_new_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM while the supervisor sleeps before restarting a worker that died at
    once: a worker started after it would never get the signal (and the supervisor
    would wait on it)."""
    starts = tmp_path / "starts"
    starts.write_text("0")

    def worker_main(config: Config, source: str, index: int, ready: Callable[[], None]) -> int:
        count = int(starts.read_text())
        starts.write_text(str(count + 1))
        if count == 0:
            return 1  # a quick death: the supervisor backs off before the restart
        ready()
        time.sleep(10)  # a worker the supervisor never signals would keep it this long
        return 0

    sup = Supervisor(
        Config(server=ServerConfig(port=0, shutdown_grace_s=1)), "test", 1, worker_main
    )

    def sleep(seconds: float) -> None:  # the backoff, interrupted by SIGTERM
        sup._on_signal(signal.SIGTERM, None)

    monkeypatch.setattr(supervisor, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    began = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - began < 5
    assert starts.read_text() == "1"


def stop_soon(sup: Supervisor, after_s: float) -> threading.Timer:
    """A SIGTERM to this process (the supervisor's handler) in ``after_s``."""
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_a_worker_that_does_not_stop_is_killed_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor waited on its workers with no deadline once stopping: one that
    never stopped (its loop blocked) kept it waiting for ever. Killed, it did not close
    (spend it had not charged is lost): the supervisor exits 1, not 0."""
    monkeypatch.setattr(supervisor, "KILL_AFTER_S", 0.5)
    monkeypatch.setattr(shutdown, "CLOSE_BOUND_S", 0.0)

    def worker_main(config: Config, source: str, index: int, ready: Callable[[], None]) -> int:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a loop that never turns again
        ready()
        time.sleep(60)
        return 0

    server = ServerConfig(port=0, drain_delay_s=0, shutdown_grace_s=0.5)
    sup = Supervisor(Config(server=server), "test", 1, worker_main)
    timer = stop_soon(sup, 0.5)
    began = time.monotonic()
    assert sup.run() == 1
    timer.join()
    assert time.monotonic() - began < 5


def test_workers_that_cannot_reach_the_store_are_started_again_without_giving_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker restarted in a Redis outage exits at once: counted as a quick death, five
    of them made the supervisor give up, stopping the workers that still served."""
    monkeypatch.setattr(supervisor, "MAX_BACKOFF_S", 0.02)
    starts = tmp_path / "starts"
    starts.write_text("0")

    def worker_main(config: Config, source: str, index: int, ready: Callable[[], None]) -> int:
        count = int(starts.read_text())
        starts.write_text(str(count + 1))
        if count < 2 * supervisor.MAX_QUICK_DEATHS:
            return supervisor.STORE_UNREACHABLE
        ready()
        time.sleep(10)
        return 0

    sup = Supervisor(Config(server=ServerConfig(port=0, drain_delay_s=0)), "test", 1, worker_main)
    timer = stop_soon(sup, 2.0)
    assert sup.run() == 0
    timer.join()
    assert int(starts.read_text()) == 2 * supervisor.MAX_QUICK_DEATHS + 1


def test_a_second_signal_during_the_drain_hurries_the_workers(tmp_path: Path) -> None:
    """The supervisor put its old handlers back before it waited for the workers: a
    second SIGTERM killed it (its workers left running), a second Ctrl-C raised
    KeyboardInterrupt; the workers were never told to hurry."""
    hurried = tmp_path / "hurried"

    def worker_main(config: Config, source: str, index: int, ready: Callable[[], None]) -> int:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # draining: the first stop is slow

        def hurry(*_: object) -> None:
            hurried.touch()
            os._exit(0)

        signal.signal(supervisor.HURRY_SIGNAL, hurry)
        ready()
        time.sleep(30)
        return 0

    server = ServerConfig(port=0, drain_delay_s=20, shutdown_grace_s=0)
    sup = Supervisor(Config(server=server), "test", 1, worker_main)
    first, second = stop_soon(sup, 0.5), stop_soon(sup, 1.0)
    began = time.monotonic()
    assert sup.run() == 0
    first.join()
    second.join()
    assert hurried.exists()
    assert time.monotonic() - began < 10

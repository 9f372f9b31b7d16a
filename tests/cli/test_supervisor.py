"""The supervisor in this process: what it does between a worker's death and its restart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from nexus import supervisor
from nexus.config import Config, ServerConfig
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

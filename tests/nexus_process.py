"""``nexus serve`` as a real process for tests: started on a free port, its log in a file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

NEXUS = str(Path(sys.executable).parent / "nexus")
SERVING = re.compile(r"Nexus serving on (http://\S+)")


def start_nexus(
    config: Path,
    log: Path,
    *args: str,
    ready: re.Pattern[str] = SERVING,
    wrap: tuple[str, ...] = (),
    session: bool = False,
) -> tuple[subprocess.Popen[bytes], re.Match[str]]:
    """``nexus serve --config config --port 0 *args``, once its log matches ``ready``;
    run by ``wrap`` (``unshare ...``), in a ``session`` of its own (its process group).

    The log goes to a file, not a pipe: nothing can block the server's logging.
    """
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*wrap, NEXUS, "serve", "--config", str(config), "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=sink,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=session,
        )
    deadline = time.monotonic() + 20
    while not (match := ready.search(log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError("nexus serve did not report its URL:\n" + log.read_text())
        time.sleep(0.05)
    return proc, match


def stop_nexus(proc: subprocess.Popen[bytes], *, gently: bool = True) -> None:
    """SIGTERM (when ``gently``), then SIGKILL if it is still there after 15 s."""
    if proc.poll() is not None:
        return
    if gently:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()

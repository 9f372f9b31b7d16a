"""A ``redis-server`` of the test's own, on a free port, that the test stops and starts.

Started without persistence (``--save "" --appendonly no``): a restart loses every
key, as a Redis restarted without persistence does. Skipped with the reason when
``redis-server`` is not installed (failed under ``CI=true``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process at a time, always on the same port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("CI") == "true":
                pytest.fail("redis-server is not installed")
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait until it accepts connections (at most 5 s)."""
        self.process = subprocess.Popen(
            [
                *(self.binary, "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--loglevel", "warning"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5.0
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers; every key is lost."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

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
        self.started = False  # once: the port is the test's, kept across restarts

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait until it accepts connections (at most 5 s). Its port is
        chosen free, not held: should another process take it first (another test worker),
        the first start tries another port; a restart, whose port the test's stores know,
        fails rather than talk to someone else's Redis."""
        for attempt in range(5):
            if self._start_once():
                self.started = True
                return
            if self.started or attempt == 4:
                raise RuntimeError(f"redis-server could not listen on port {self.port}")
            self.port = _free_port()

    def _start_once(self) -> bool:
        """Whether the ``redis-server`` started answers on the port (not another's)."""
        self.process = process = subprocess.Popen(
            [
                *(self.binary, "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--loglevel", "warning"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5.0
        while process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"INFO server\r\n")
                    reply = b""
                    while b"process_id:" not in reply or not reply.endswith(b"\r\n\r\n"):
                        data = sock.recv(65536)
                        if not data:
                            break
                        reply += data
                    ours = f"process_id:{process.pid}\r\n".encode() in reply
                    if not ours:
                        self.stop()
                    return ours
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    return False
                time.sleep(0.02)
        self.process = None  # exited: the port was taken
        return False

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

"""``python -m bench.memory`` runs end to end (20 streams), so the tool does not rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("system", ["nexus", "rawproxy"])
def test_the_memory_tool_reports_bytes_a_stream(system: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--system", system, "--streams", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # (20 streams: the warm-up's garbage weighs on the figure; its form is what is checked)
    assert re.search(r"^-?[\d,]+ bytes a stream in all$", done.stdout, re.M), done.stdout[-2000:]
    assert "by allocating line, with its callers:" in done.stdout

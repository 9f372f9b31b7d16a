"""The installed package is typed for its users' type checkers (PEP 561)."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import nexus

CONSUMER = """
from nexus import Completion, Delta, Encoder, StreamEvent


class Plain(Encoder):
    media_type = "text/plain"

    def encode(self, event: StreamEvent) -> bytes:
        return event.content.encode() if isinstance(event, Delta) and event.content else b""


def content(completion: Completion) -> int:
    return completion.content
"""


def test_the_package_ships_its_py_typed_marker() -> None:
    assert (resources.files("nexus") / "py.typed").is_file()


def test_mypy_sees_an_installed_nexus_with_its_types(tmp_path: Path) -> None:
    """Installed (found through site-packages, not the sources), nexus without the marker
    is Any to mypy: the subclass of ``Any`` and the wrong return go unreported."""
    pytest.importorskip("mypy")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    installed = tmp_path / "installed"
    installed.mkdir()
    (installed / "nexus").symlink_to(Path(nexus.__file__).parent)
    (Path(purelib) / "nexus.pth").write_text(f"{installed}\n")
    (tmp_path / "consumer.py").write_text(CONSUMER)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--no-error-summary",
         "--python-executable", str(python), "--cache-dir", str(tmp_path / "cache"),
         "consumer.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.stdout.splitlines() == [
        'consumer.py:13: error: Incompatible return value type (got "str", expected "int")  '
        "[return-value]"
    ]

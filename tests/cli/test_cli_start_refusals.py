"""``nexus serve`` refusing, in one line and exit code 2, what it took before and then failed
on or served wrongly: an upstream URL no connection can use (a traceback at start, and with
``--workers 2`` each worker's restart loop), no provider left once the optional ones without
their key were left out (it served, every request ``model_not_found``), and ``--loop
uvloop`` without uvloop (blamed on the file's ``[server] uvloop``, which it never set)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nexus_process import NEXUS

UNSET = "NEXUS_TEST_KEY_NEVER_SET"


def serve(
    path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != UNSET}
    done = subprocess.run(
        [NEXUS, "serve", "--config", str(path), "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=20,
        env={**environ, **(env or {})},
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done


def said(done: subprocess.CompletedProcess[str]) -> str:
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("nexus:")]
    return line


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:99999/v1", "the port must be a number from 1 to 65535"),
        ("http://host:abc/v1", "the port must be a number from 1 to 65535"),
        ("http://:80/v1", "no host in the URL"),
        ("http://[::1/v1", "the host is not a valid IPv6 address between [ and ]"),
    ],
)
def test_a_base_url_no_connection_can_use_is_one_line(
    tmp_path: Path, url: str, why: str, workers: list[str]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[providers.o]\nkind = "openai"\nbase_url = "{url}"\n')
    done = serve(path, *workers)
    assert said(done) == f"nexus: config error: {path}: [providers.o] base_url: {why}"
    assert len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
def test_every_provider_optional_and_left_out_is_a_config_error(
    tmp_path: Path, workers: list[str]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[providers.a]\nkind = "openai"\napi_key_env = "{UNSET}"\noptional = true\n\n'
        f'[providers.b]\nkind = "anthropic"\napi_key_env = "{UNSET}"\noptional = true\n'
    )
    done = serve(path, *workers)
    assert said(done) == (
        f"nexus: config error: {path}: [providers]: at least one provider is required, and "
        "every one is optional = true with its api_key_env unset: all were left out"
    )


def test_loop_uvloop_without_uvloop_names_the_flag(tmp_path: Path) -> None:
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "uvloop.py").write_text('raise ImportError("uvloop is not installed (a stub)")\n')
    path = tmp_path / "h1.toml"
    path.write_text('[providers.mock]\nkind = "mock"\n')
    pythonpath = f"{stub}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    done = serve(path, "--loop", "uvloop", env={"PYTHONPATH": pythonpath})
    assert said(done) == (
        "nexus: config error: --loop uvloop: uvloop is not installed "
        "(pip install 'nexus-gateway[uvloop]')"
    )

"""`nexus hash-key`, the refusal to serve an open gateway on a public interface, JSON logs."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

NEXUS = str(Path(sys.executable).parent / "nexus")


def test_hash_key_makes_a_key_and_its_config_entry() -> None:
    out = subprocess.run([NEXUS, "hash-key", "--name", "ci"], capture_output=True, text=True)
    assert out.returncode == 0
    key = re.search(r"^key:\s+(\S+)$", out.stdout, re.M)
    digest = re.search(r'^sha256 = "([0-9a-f]{64})"$', out.stdout, re.M)
    assert key is not None and digest is not None
    assert len(key[1]) >= 40
    assert hashlib.sha256(key[1].encode()).hexdigest() == digest[1]
    assert 'name = "ci"' in out.stdout


def test_hash_key_hashes_a_key_from_stdin() -> None:
    out = subprocess.run(
        [NEXUS, "hash-key", "--stdin"], input="s3cret\n", capture_output=True, text=True
    )
    assert out.stdout.strip() == hashlib.sha256(b"s3cret").hexdigest()
    empty = subprocess.run([NEXUS, "hash-key", "--stdin"], input="", capture_output=True)
    assert empty.returncode == 2


def test_an_open_gateway_on_a_public_interface_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[providers.mock]\nkind = "mock"\n')
    out = subprocess.run(
        [NEXUS, "serve", "--config", str(config), "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "refusing to serve on 0.0.0.0 without API keys" in out.stderr
    assert "allow_unauthenticated" in out.stderr


def test_json_logs_carry_the_request_id_and_no_secrets(tmp_path: Path) -> None:
    key = "nx-test-key-never-logged"
    digest = hashlib.sha256(key.encode()).hexdigest()
    config = tmp_path / "config.toml"
    config.write_text(
        '[logging]\nformat = "json"\n[[auth.keys]]\nname = "ci"\n'
        f'sha256 = "{digest}"\n[providers.mock]\nkind = "mock"\n'
    )
    proc = subprocess.Popen(
        [NEXUS, "serve", "--config", str(config), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        url = None
        for line in proc.stderr:
            record = orjson.loads(line)
            match = re.search(r"http://\S+", record["message"])
            if match:
                url = match[0]
                break
        assert url is not None
        body = orjson.dumps(
            {
                "model": "mock/echo",
                "stream": True,
                "messages": [{"role": "user", "content": "a very private prompt"}],
            }
        )
        request = urllib.request.Request(
            url + "/v1/chat/completions?stream_format=ndjson",
            data=body,
            headers={
                "Authorization": f"Bearer {key}",
                "Content-Type": "application/json",
                "X-Request-Id": "trace-42",
            },
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            request_id = resp.headers["X-Request-Id"]
            assert resp.headers["X-Client-Request-Id"] == "trace-42"
            assert b"private" in resp.read()
        time.sleep(0.2)
    finally:
        proc.terminate()
        rest = proc.stderr.read()
        proc.stderr.close()
        proc.wait(15)
    records = [orjson.loads(line) for line in rest.splitlines() if line.strip()]
    access = [r for r in records if r["logger"] == "nexus.access"]
    assert len(access) == 1
    line = access[0]
    assert (line["request_id"], line["client_request_id"]) == (request_id, "trace-42")
    assert line["status"] == 200
    assert line["format"] == "application/x-ndjson"
    assert line["provider"] == "mock"
    assert line["key"] == "ci"
    assert line["events"] > 0 and line["bytes"] > 0
    assert line["ttfb_ms"] is not None and line["duration_ms"] >= line["ttfb_ms"]
    assert key not in rest and "private" not in rest


def test_any_pages_origin_without_keys_is_refused(tmp_path: Path) -> None:
    """Every site its user opened could spend the providers through a keyless gateway."""
    config = tmp_path / "config.toml"
    config.write_text('[cors]\nallow_origins = ["*"]\n[providers.mock]\nkind = "mock"\n')
    out = subprocess.run(
        [NEXUS, "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "refusing [cors] allow_origins = ['*'] without API keys" in out.stderr

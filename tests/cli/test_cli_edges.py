"""Small edges of the ``nexus`` command: each was a traceback or a line that misled.

* ``--log-level bogus``: a ``ValueError`` traceback; now argparse's one line, exit 2.
* ``hash-key --name`` with a newline or a quote printed an entry that injected TOML
  (or did not load); now the key-name rule of ``[[auth.keys]]`` applies, exit 2.
* A ``--host`` that does not resolve: "Unknown error -2"; now the resolver's text.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nexus_process import NEXUS


def test_an_unknown_log_level_is_one_line() -> None:
    done = subprocess.run(
        [NEXUS, "serve", "--log-level", "bogus"], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "--log-level: invalid choice: 'BOGUS'" in done.stderr


@pytest.mark.parametrize("name", ['x"\nsha256 = "0', "a b", "", "n" * 65])
def test_hash_key_refuses_a_name_the_config_would_not_take(name: str) -> None:
    done = subprocess.run([NEXUS, "hash-key", "--name", name], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stdout == ""
    assert "--name: a key name is 1 to 64 characters" in done.stderr


def test_a_host_that_does_not_resolve_is_said_so(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[auth]\nallow_unauthenticated = true\n\n[providers.mock]\nkind = "mock"\n')
    done = subprocess.run(
        [NEXUS, "serve", "--config", str(config), "--host", "nohost.invalid", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    [line] = [x for x in done.stderr.splitlines() if x.startswith("nexus: cannot serve")]
    assert line.startswith("nexus: cannot serve on nohost.invalid:0: ")
    assert "Unknown error" not in line
    assert len(line) > len("nexus: cannot serve on nohost.invalid:0: ") + 5

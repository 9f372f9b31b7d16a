#!/usr/bin/env bash
# Install the LiteLLM proxy into its own virtual environment for the benchmark.
#
#   bash bench/litellm/setup.sh            # creates bench/.litellm-venv
#   LITELLM_VENV=/some/dir bash bench/litellm/setup.sh
#
# The venv is separate from the harness's and from Nexus's: LiteLLM pins its own
# versions of pydantic, openai, fastapi, aiohttp ... and must not disturb them.
# Needs PyPI once; after that the proxy runs fully offline (see system.py).
set -euo pipefail

# 1.106.2: newest release whose requirements resolve from PyPI as reached here
# (1.106.3+ and 1.108/1.109 require certifi>=2026.10.19, not yet published there;
# 1.107.x is gone from the index: reported as a compromised release -- avoid it).
LITELLM_VERSION="${LITELLM_VERSION:-1.106.2}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${LITELLM_VENV:-$here/../.litellm-venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# This machine's pip config names local extra indexes that may not exist; drop
# pip's "Location ... is ignored" noise (errors still show, and still fail).
pip_install() {
    "$venv/bin/python" -m pip install --quiet "$@" 2>&1 | { grep -v 'is ignored: it is neither' || true; }
}
installed="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' 2>/dev/null || true)"
if [ "$installed" != "$LITELLM_VERSION" ]; then
    pip_install --upgrade pip
    pip_install "litellm[proxy]==${LITELLM_VERSION}"
fi

# Smoke check: the CLI imports and reports its version without network access.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
print("litellm", md.version("litellm"), "installed")
PY
LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/litellm" --help >/dev/null
echo "litellm executable: $(cd "$venv" && pwd)/bin/litellm"

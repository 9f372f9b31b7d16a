"""How the benchmark harness starts the LiteLLM proxy as a system under test.

Standard library only: this module is imported from the harness's environment,
not from LiteLLM's venv (``bench/.litellm-venv``, made by ``setup.sh``).

The proxy gets one model, :data:`MODEL`, routed as ``openai/bench`` to the fake
OpenAI-compatible upstream. It runs with one uvicorn worker, no database, the
master key :data:`API_KEY`, no network access (the model cost map and other remote JSON files
are read from the package) and logging at ERROR, so that no per-request line is
written -- Nexus is benchmarked with its access log off as well.

Typical use::

    exe = find_litellm()                    # None: run setup.sh first, or skip
    argv, env = litellm_command("http://127.0.0.1:9000/v1", 4000, workdir)
    proc = subprocess.Popen(argv, env=env, cwd=workdir)
    # poll http://127.0.0.1:4000 + READY_PATH until 200, then send
    # POST /v1/chat/completions {"model": MODEL, "stream": true, ...}
    # with headers {"Authorization": f"Bearer {API_KEY}"}
"""

from __future__ import annotations

import json
import os
import pathlib

__all__ = ["API_KEY", "MODEL", "READY_PATH", "find_litellm", "litellm_command"]

#: The model name clients send in the request body.
MODEL = "bench"

#: Clients must send ``Authorization: Bearer sk-bench``: it is the proxy's
#: master key (LiteLLM refuses to start without one), and also the key LiteLLM
#: forwards to the upstream.
API_KEY = "sk-bench"

#: Answers 200 once the proxy is serving (no database or upstream is touched).
READY_PATH = "/health/liveliness"

#: Environment variable naming the ``litellm`` executable, overriding the venv.
ENV_OVERRIDE = "NEXUS_BENCH_LITELLM"

_BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_EXECUTABLE = _BENCH_DIR / ".litellm-venv" / "bin" / "litellm"

# Settings that make the proxy run offline, quietly and without state.
_OFFLINE_ENV = {
    # Read model_prices_and_context_window.json (and the other remote JSON files
    # it would fetch at import/startup) from the installed package: no network.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    # ERROR: no per-request log lines from LiteLLM, and uvicorn's log level (so
    # its access log) follows it.
    "LITELLM_LOG": "ERROR",
    # No admin UI or docs pages to build/mount: a headless API deployment.
    "DISABLE_ADMIN_UI": "True",
    "NO_DOCS": "True",
    "NO_REDOC": "True",
    # Do not try to run prisma schema migrations (there is no database anyway).
    "DISABLE_SCHEMA_UPDATE": "True",
    # No tokenizer downloads from the Hugging Face hub if anything asks for one.
    "HF_HUB_OFFLINE": "1",
    # The upstream is on loopback: never route it through a proxy.
    "NO_PROXY": "127.0.0.1,localhost,::1",
    "no_proxy": "127.0.0.1,localhost,::1",
    "PYTHONUNBUFFERED": "1",
}

# Inherited variables that would give the proxy state or auth it should not have
# in this benchmark (a database, Redis, a master key, a stray config file).
_DROP_ENV = (
    "DATABASE_URL",
    "DIRECT_URL",
    "LITELLM_MASTER_KEY",
    "LITELLM_SALT_KEY",
    "LITELLM_LICENSE",
    "CONFIG_FILE_PATH",
    "WORKER_CONFIG",
    "STORE_MODEL_IN_DB",
    "REDIS_HOST",
    "REDIS_PORT",
    "REDIS_PASSWORD",
    "REDIS_URL",
    "REDIS_CLUSTER_NODES",
    "REDIS_SENTINEL_NODES",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "NUM_WORKERS",
    "LITELLM_ENABLE_PYROSCOPE",
)


def find_litellm() -> str | None:
    """Path of the ``litellm`` executable, or None when it is not installed.

    ``$NEXUS_BENCH_LITELLM`` wins when set (None if it names no executable
    file); otherwise ``bench/.litellm-venv/bin/litellm`` from ``setup.sh``.
    """
    override = os.environ.get(ENV_OVERRIDE)
    candidate = pathlib.Path(override).expanduser() if override else DEFAULT_EXECUTABLE
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return None


def _config(upstream_base_url: str) -> str:
    # JSON is valid YAML: no YAML library needed on the harness side.
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": "openai/bench",
                    "api_base": upstream_base_url,
                    "api_key": API_KEY,
                },
            }
        ],
        "litellm_settings": {
            "drop_params": True,
            # A failed upstream call fails the request, as in Nexus's benchmark:
            # no hidden retries or fallbacks that change the load.
            "num_retries": 0,
        },
        "router_settings": {"num_retries": 0},
        "general_settings": {
            # LiteLLM (1.10x) refuses to start without a master key; with no
            # database, checking it is a string compare per request.
            "master_key": API_KEY,
            "disable_spend_logs": True,
            "disable_error_logs": True,
        },
    }
    return json.dumps(config, indent=2) + "\n"


def litellm_command(
    upstream_base_url: str, port: int, workdir: pathlib.Path
) -> tuple[list[str], dict[str, str]]:
    """Write ``litellm-config.yaml`` into workdir; return (argv, env) to start it.

    upstream_base_url is the OpenAI-compatible base including ``/v1``, e.g.
    ``http://127.0.0.1:9000/v1``. The proxy listens on 127.0.0.1:port with one
    worker. env is the complete environment for the child (``Popen(env=env)``):
    the caller's environment with database/auth/proxy variables removed and
    the offline/quiet settings above added. Raises FileNotFoundError when
    LiteLLM is not installed (see ``setup.sh``).
    """
    exe = find_litellm()
    if exe is None:
        raise FileNotFoundError(
            f"litellm not found: run bench/litellm/setup.sh or set ${ENV_OVERRIDE}"
        )
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "litellm-config.yaml"
    config_path.write_text(_config(upstream_base_url), encoding="utf-8")

    argv = [
        exe,
        "--config",
        str(config_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(_OFFLINE_ENV)
    return argv, env

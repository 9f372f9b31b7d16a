"""``config.toml``: defaults, the shipped file, and errors that name file, key and problem."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from config_tables import REQUIRED, tables
from nexus.config import (
    Config,
    LimitsConfig,
    MockProviderConfig,
    ModelAliasConfig,
    ServerConfig,
    load_config,
    parse_config,
)
from nexus.config_types import Table
from nexus.errors import ConfigError

REPO_CONFIG = Path(__file__).resolve().parents[2] / "config.toml"


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "nexus.toml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def load_error(tmp_path: Path, text: str | bytes) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message[len(f"{path}: ") :]


def test_empty_file_gives_every_default(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""))
    assert config == Config()
    assert config.server == ServerConfig(
        host="127.0.0.1",
        port=8080,
        heartbeat_interval_s=15.0,
        retry_ms=3000,
        shutdown_grace_s=10.0,
        write_timeout_s=30.0,
        uvloop="auto",
        backlog=2048,
        workers=1,
    )
    assert config.limits == LimitsConfig(max_body_bytes=33554432, max_concurrent_streams=10000)
    assert config.encoders == {}
    assert config.providers == {"mock": MockProviderConfig(kind="mock", models=["echo"])}
    assert config.models == {}


def test_repo_config_toml_is_the_builtin_default() -> None:
    # config.toml says it is "the embedded default"; it must load to exactly Config().
    loaded = load_config(REPO_CONFIG)
    assert loaded.model_dump() == Config().model_dump()
    assert loaded == Config()


def test_repo_config_toml_loads_from_a_str_path() -> None:
    config = load_config(str(REPO_CONFIG))
    assert config.server.port == 8080
    assert config.server.heartbeat_interval_s == 15.0
    assert config.limits.max_body_bytes == 32 * 1024 * 1024
    assert list(config.providers) == ["mock"]


def test_every_table_and_key(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            """
[server]
host = "0.0.0.0"
port = 0
heartbeat_interval_s = 0.5
retry_ms = 0
shutdown_grace_s = 0
write_timeout_s = 2.5
uvloop = true
workers = "auto"

[limits]
max_body_bytes = 1
max_concurrent_streams = 1

[encoders]
"application/x-custom" = "my_package.encoders:CustomEncoder"

[providers.mock]
kind = "mock"
models = ["echo", "big"]

[providers."other.mock"]
kind = "mock"

[models."demo"]
targets = ["mock/echo", "other.mock/x"]
""",
        )
    )
    assert config.server == ServerConfig(
        host="0.0.0.0",
        port=0,
        heartbeat_interval_s=0.5,
        retry_ms=0,
        shutdown_grace_s=0.0,
        write_timeout_s=2.5,
        uvloop=True,
        workers="auto",
    )
    assert config.limits == LimitsConfig(max_body_bytes=1, max_concurrent_streams=1)
    # [encoders] values are stored as given; they are imported when the app starts.
    assert config.encoders == {"application/x-custom": "my_package.encoders:CustomEncoder"}
    assert config.providers == {
        "mock": MockProviderConfig(kind="mock", models=["echo", "big"]),
        "other.mock": MockProviderConfig(kind="mock"),
    }
    assert config.models == {"demo": ModelAliasConfig(targets=["mock/echo", "other.mock/x"])}


def test_a_table_can_be_partial(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[server]\nport = 9000\n"))
    assert config.server == ServerConfig(port=9000)
    assert config.server.host == "127.0.0.1"
    assert config.providers == Config().providers


def test_config_is_frozen() -> None:
    config = Config()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.server.port = 1  # type: ignore[misc]
    assert config.server.port == 8080


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("[foo]\na = 1\n", "[foo]: unknown table or key", id="unknown-table"),
        pytest.param("foo = 1\n", "[foo]: unknown table or key", id="unknown-top-level-key"),
        pytest.param(
            "[server]\nheartbeat_interval = 5\n",
            "[server] heartbeat_interval: unknown key "
            "(check the spelling against docs/configuration.md)",
            id="unknown-key-server",
        ),
        pytest.param(
            "[limits]\nmax_streams = 5\n",
            "[limits] max_streams: unknown key (check the spelling against docs/configuration.md)",
            id="unknown-key-limits",
        ),
        pytest.param(
            '[providers.mock]\nkind = "mock"\nmodel = ["x"]\n',
            "[providers.mock] model: unknown key "
            "(check the spelling against docs/configuration.md)",
            id="unknown-key-provider",
        ),
        pytest.param(
            '[server]\nport = "eighty"\n',
            "[server] port: Input should be a valid integer",
            id="wrong-type-port-string",
        ),
        pytest.param(
            "[server]\nhost = 5\n",
            "[server] host: Input should be a valid string",
            id="wrong-type-host",
        ),
        pytest.param(
            "[server]\nretry_ms = 1.5\n",
            "[server] retry_ms: Input should be a valid integer",
            id="wrong-type-fractional",
        ),
        pytest.param(
            '[encoders]\n"application/x-custom" = 5\n',
            "[encoders] application/x-custom: Input should be a valid string",
            id="wrong-type-encoder-spec",
        ),
        pytest.param(
            "[server]\nport = true\n",
            "[server] port: Input should be a valid integer",
            id="wrong-type-port-boolean",
        ),
        pytest.param(
            "[server]\nheartbeat_interval_s = 0\n",
            "[server] heartbeat_interval_s: Input should be greater than or equal to 0.01",
            id="heartbeat-zero",
        ),
        pytest.param(
            "[server]\nport = 65536\n",
            "[server] port: Input should be less than or equal to 65535",
            id="port-too-big",
        ),
        pytest.param(
            "[server]\nretry_ms = -1\n",
            "[server] retry_ms: Input should be greater than or equal to 0",
            id="retry-negative",
        ),
        pytest.param(
            "[limits]\nmax_concurrent_streams = 0\n",
            "[limits] max_concurrent_streams: Input should be greater than or equal to 1",
            id="streams-zero",
        ),
        pytest.param(
            '[models."x"]\ntargets = ["openai/gpt-4o"]\n',
            "[models.\"x\"] targets: 'openai/gpt-4o' must be '<provider>/<model>' "
            "with a provider among ['mock']",
            id="alias-unknown-provider",
        ),
        pytest.param(
            '[models."x"]\ntargets = ["mock/echo", "echo"]\n',
            "[models.\"x\"] targets: 'echo' must be '<provider>/<model>' "
            "with a provider among ['mock']",
            id="alias-target-without-provider",
        ),
        pytest.param(
            '[models."x"]\ntargets = ["mock/"]\n',
            "[models.\"x\"] targets: 'mock/' must be '<provider>/<model>' "
            "with a provider among ['mock']",
            id="alias-target-without-model",
        ),
        pytest.param(
            '[models."x"]\ntargets = []\n',
            '[models."x"] targets: an alias needs at least one target',
            id="alias-no-targets",
        ),
        pytest.param(
            '[models."x"]\n',
            '[models."x"] targets: required key is missing',
            id="alias-targets-missing",
        ),
        pytest.param(
            '[providers.openai]\nkind = "gemini"\n',
            "[providers.openai] kind: unknown kind 'gemini' "
            "(expected 'mock', 'openai', 'anthropic')",
            id="provider-kind-unknown",
        ),
        pytest.param(
            "[providers.p]\nmodels = []\n",
            "[providers.p] kind: required key is missing",
            id="provider-kind-missing",
        ),
        pytest.param(
            '[providers."a.b"]\nkind = "openai"\nbase_url = "ftp://x"\n',
            "[providers.\"a.b\"] base_url: String should match pattern '^https?://\\S+$'",
            id="dotted-provider-name-quoted",
        ),
        pytest.param(
            '[server]\nworkers = "many"\n',
            "[server] workers: expected a number of workers (1 or more) or \"auto\", not 'many'",
            id="workers-not-a-count",
        ),
        pytest.param(
            "[server]\nworkers = 0\n",
            '[server] workers: expected a number of workers (1 or more) or "auto", not 0',
            id="workers-zero",
        ),
        pytest.param(
            "providers = {}\n",
            "providers: at least one provider is required",
            id="no-providers",
        ),
        pytest.param(
            '[providers."a/b"]\nkind = "mock"\n',
            "providers: provider name 'a/b' must be 1 to 64 characters, without '/', '*', "
            "spaces or control characters",
            id="provider-name-with-slash",
        ),
        pytest.param(
            '[providers."a b"]\nkind = "mock"\n',
            "providers: provider name 'a b' must be 1 to 64 characters, without '/', '*', "
            "spaces or control characters",
            id="provider-name-with-space",
        ),
        pytest.param(
            '[providers.""]\nkind = "mock"\n',
            "providers: provider name '' must be 1 to 64 characters, without '/', '*', "
            "spaces or control characters",
            id="provider-name-empty",
        ),
        pytest.param(
            '[models.""]\ntargets = ["mock/echo"]\n',
            "models: model name '' must be 1 to 256 characters, without spaces or control "
            "characters",
            id="alias-name-empty",
        ),
        pytest.param(
            '[models."my alias"]\ntargets = ["mock/echo"]\n',
            "models: model name 'my alias' must be 1 to 256 characters, without spaces or "
            "control characters",
            id="alias-name-with-space",
        ),
        pytest.param(
            '[providers.mock]\nkind = "mock"\nmodels = ["echo", ""]\n',
            "[providers.mock] models.1: model name '' must be 1 to 256 characters, without "
            "spaces or control characters",
            id="provider-model-empty",
        ),
        pytest.param(
            '[cors]\nallow_origins = ["https://a.example", "not an origin"]\n',
            "[cors] allow_origins.1: 'not an origin' is not an origin as a browser sends it: "
            '"*", "null" or scheme://host[:port] in lower case, without a default port, path '
            'or wildcard (e.g. "https://app.example.com")',
            id="cors-origin-junk",
        ),
        pytest.param(
            '[cors]\nallow_origins = [""]\n',
            "[cors] allow_origins.0: '' is not an origin as a browser sends it: "
            '"*", "null" or scheme://host[:port] in lower case, without a default port, path '
            'or wildcard (e.g. "https://app.example.com")',
            id="cors-origin-empty",
        ),
        pytest.param(
            '[cors]\nallow_origins = ["https://app.example.com/"]\n',
            "[cors] allow_origins.0: 'https://app.example.com/' is not an origin as a browser "
            'sends it: "*", "null" or scheme://host[:port] in lower case, without a default '
            "port, path or wildcard (a browser sends it as 'https://app.example.com')",
            id="cors-origin-with-path",
        ),
        pytest.param(
            '[cors]\nallow_origins = ["https://App.Example.com:443"]\n',
            "[cors] allow_origins.0: 'https://App.Example.com:443' is not an origin as a "
            'browser sends it: "*", "null" or scheme://host[:port] in lower case, without a '
            "default port, path or wildcard (a browser sends it as 'https://app.example.com')",
            id="cors-origin-never-sent-so",
        ),
        pytest.param(
            '[cors]\nallow_origins = ["https://*.example.com"]\n',
            "[cors] allow_origins.0: 'https://*.example.com' is not an origin as a browser "
            'sends it: "*", "null" or scheme://host[:port] in lower case, without a default '
            'port, path or wildcard (e.g. "https://app.example.com")',
            id="cors-origin-wildcard",
        ),
        pytest.param(
            '[providers.a]\nkind = "anthropic"\nanthropic_version = ""\n',
            "[providers.a] anthropic_version: String should have at least 1 character",
            id="anthropic-version-empty",
        ),
        pytest.param(
            '[server]\nuvloop = "yes"\n',
            "[server] uvloop: expected true, false or \"auto\", not 'yes'",
            id="uvloop-not-a-choice",
        ),
        pytest.param(
            "[server]\nbacklog = 2147483648\n",
            "[server] backlog: Input should be less than or equal to 65535",
            id="backlog-too-big",
        ),
        pytest.param(
            "[realtime]\nmax_message_bytes = 4294967296\n",
            "[realtime] max_message_bytes: Input should be less than or equal to 1073741824",
            id="ws-message-too-big",
        ),
    ],
)
def test_invalid_config_names_file_key_and_problem(tmp_path: Path, text: str, message: str) -> None:
    assert load_error(tmp_path, text) == message


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("[server\n", "Expected ']' at the end of a table declaration (at line 1, column 8)"),
        ("[server]\nport = \n", "Invalid value (at line 2, column 8)"),
        ("[server]\nport = 1\nport = 2\n", "Cannot overwrite a value (at line 3, column 9)"),
    ],
)
def test_invalid_toml(tmp_path: Path, text: str, detail: str) -> None:
    assert load_error(tmp_path, text) == f"not valid TOML: {detail}"


def test_invalid_utf8(tmp_path: Path) -> None:
    message = load_error(tmp_path, b'[server]\nhost = "\xff"\n')
    assert message.startswith("not valid TOML: 'utf-8' codec can't decode byte 0xff")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: cannot read the config file: No such file or directory"


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(info.value) == f"{tmp_path}: cannot read the config file: Is a directory"


def test_an_api_key_env_that_is_not_a_variable_name_is_refused_without_repeating_it() -> None:
    # The likeliest mistake is the key itself in the place of its variable's name: the
    # error must not put it in a log or a terminal's scrollback.
    provider = {"kind": "openai", "base_url": "https://api.openai.com/v1"}
    for value in ("sk-proj-Abc123Secret456", "my key", "1ST"):
        with pytest.raises(ConfigError) as refused:
            parse_config({"providers": {"o": {**provider, "api_key_env": value}}})
        assert value not in str(refused.value)
        assert "api_key_env" in str(refused.value)
    named = parse_config({"providers": {"o": {**provider, "api_key_env": "OPENAI_API_KEY_2"}}})
    assert named.providers["o"].api_key_env == "OPENAI_API_KEY_2"  # type: ignore[union-attr]


@pytest.mark.parametrize("key", ["drain_delay_s", "shutdown_grace_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 86401.0])
def test_the_shutdown_waits_are_finite(key: str, value: float) -> None:
    # drain_delay_s = 1e309 was taken: the process then served on "for infs", deaf to signals.
    with pytest.raises(ConfigError) as refused:
        parse_config({"server": {key: value}})
    assert f"[server] {key}" in str(refused.value)


FLOAT_KEYS = [
    (table, key)
    for table in tables(Table)
    for key, field in table.model_fields.items()
    if "float" in str(field.annotation)
]


def test_the_float_keys_are_all_found() -> None:
    # (a walk that found none would pass the check below)
    keys = {(table.__name__, key) for table, key in FLOAT_KEYS}
    assert {
        ("ServerConfig", "heartbeat_interval_s"),
        ("LimitsConfig", "requests_per_second_per_key"),
        ("CacheConfig", "ff_divisor"),
        ("OpenAIProviderConfig", "idle_timeout_s"),
        ("ModelAliasConfig", "input_usd_per_mtok"),
        ("AuthKeyConfig", "budget_usd"),
    } <= keys


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize(
    ("table", "key"), FLOAT_KEYS, ids=[f"{t.__name__}.{k}" for t, k in FLOAT_KEYS]
)
def test_every_float_key_is_finite(table: type[pydantic.BaseModel], key: str, value: float) -> None:
    # One rule: "no limit" is what the docs give for a key (0, or unset), never inf, which
    # reached timers and rates; and a NaN is called what it is, not "greater than 0".
    with pytest.raises(pydantic.ValidationError) as refused:
        table.model_validate({**REQUIRED.get(table.__name__, {}), key: value})
    assert [e["msg"] for e in refused.value.errors()] == ["Input should be a finite number"]


def test_an_infinite_duration_in_the_file_names_the_key(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[streams]\nresume_ttl_s = inf\n")
    assert message == "[streams] resume_ttl_s: Input should be a finite number"


def test_provider_names_people_use_are_accepted() -> None:
    names = ["azure:east", "a+b", "vllm.local", "openai-2", "gpt@home", "ünï"]
    providers = {name: {"kind": "mock"} for name in names}
    assert list(parse_config({"providers": providers}).providers) == names


@pytest.mark.parametrize(
    "origin",
    [
        "*",
        "null",
        "https://app.example.com",
        "http://localhost:3000",
        "http://127.0.0.1:5173",
        "http://[::1]:8080",
        "chrome-extension://abcdefghijklmnop",
        "https://xn--bcher-kva.example",
    ],
)
def test_an_origin_as_a_browser_sends_it_is_accepted(origin: str) -> None:
    assert parse_config({"cors": {"allow_origins": [origin]}}).cors.allow_origins == [origin]

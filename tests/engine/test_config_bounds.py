"""Values the config took that failed only later: an upstream's or Redis's URL whose host or
port no connection can use (a traceback at start, in every worker over and over), and a
duration too long for Redis or a timer (``resume_ttl_s = 1e16``: every stream a 503, Redis
saying "value is not an integer or out of range"). Each is now an error naming its key."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from config_tables import REQUIRED, tables
from nexus.config import load_config, parse_config
from nexus.config_types import Table
from nexus.errors import ConfigError

BAD_HOSTS_AND_PORTS = [
    ("http://127.0.0.1:99999/v1", "the port must be a number from 1 to 65535"),
    ("http://host:abc/v1", "the port must be a number from 1 to 65535"),
    ("http://host:0/v1", "the port must be a number from 1 to 65535"),
    ("http://:80/v1", "no host in the URL"),
    ("http://[::1/v1", "the host is not a valid IPv6 address between [ and ]"),
    ("http://[not-v6]/v1", "the host is not a valid IPv6 address between [ and ]"),
]


def config_error(data: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as refused:
        parse_config(data, "config.toml")
    return str(refused.value)


@pytest.mark.parametrize(("url", "why"), BAD_HOSTS_AND_PORTS)
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_base_url_no_connection_can_use_is_a_config_error(kind: str, url: str, why: str) -> None:
    error = config_error({"providers": {"o": {"kind": kind, "base_url": url}}})
    assert error == f"config.toml: [providers.o] base_url: {why}"


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8080/v1", "https://[::1]:8443/v1", "http://h:/v1", "https://h"]
)
def test_a_base_url_a_connection_can_use_is_taken(url: str) -> None:
    config = parse_config({"providers": {"o": {"kind": "openai", "base_url": url}}})
    assert config.providers["o"].base_url == url  # type: ignore[union-attr]


@pytest.mark.parametrize(("url", "why"), BAD_HOSTS_AND_PORTS)
def test_a_store_url_no_connection_can_use_is_a_config_error(url: str, why: str) -> None:
    url = url.replace("http://", "redis://").replace("/v1", "/0")
    error = config_error({"store": {"kind": "redis", "url": url}})
    assert error == f"config.toml: [store] url: not a Redis URL the client can use: {why}"


@pytest.mark.parametrize("path", ["/7x", "/1/2", "/db0", "/²"])
def test_a_store_url_whose_database_is_no_number_is_a_config_error(path: str) -> None:
    """The client took "/7x" for database 0 and "/1/2" for 12: a typo shared another
    environment's budgets under the same prefix, without a word."""
    error = config_error({"store": {"kind": "redis", "url": f"redis://127.0.0.1:6379{path}"}})
    assert error.endswith(
        "not a Redis URL the client can use: its path must be a database number, as /0"
    )


DURATIONS = [
    (table, key)
    for table in tables(Table)
    for key in table.model_fields
    if key.endswith(("_s", "_ms"))
]


def test_the_durations_are_all_found() -> None:
    keys = {(table.__name__, key) for table, key in DURATIONS}
    assert {
        ("ServerConfig", "retry_ms"),
        ("StreamsConfig", "resume_ttl_s"),
        ("CacheConfig", "ttl_s"),
        ("CorsConfig", "max_age_s"),
        ("RedisStoreConfig", "pool_timeout_s"),
        ("OpenAIProviderConfig", "idle_timeout_s"),
        ("PluginConfig", "timeout_s"),
    } <= keys


@pytest.mark.parametrize(
    ("table", "key"), DURATIONS, ids=[f"{t.__name__}.{k}" for t, k in DURATIONS]
)
def test_every_duration_has_an_upper_bound(table: type[pydantic.BaseModel], key: str) -> None:
    kind = table.model_fields[key].annotation
    huge: float = 10**16 if kind is int else 1e300
    with pytest.raises(pydantic.ValidationError) as refused:
        table.model_validate({**REQUIRED.get(table.__name__, {}), key: huge})
    (error,) = refused.value.errors()
    assert error["loc"] == (key,)
    assert "less than or equal to" in error["msg"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[streams]\nresume_ttl_s = 1e16\n",
            "[streams] resume_ttl_s: Input should be less than or equal to 1000000000 "
            "(seconds: about 31 years)",
        ),
        (
            "[cache]\nttl_s = 1e300\n",
            "[cache] ttl_s: Input should be less than or equal to 1000000000 "
            "(seconds: about 31 years)",
        ),
        (
            "[server]\nretry_ms = 10000000000000\n",
            "[server] retry_ms: Input should be less than or equal to 1000000000000 "
            "(milliseconds: about 31 years)",
        ),
        (  # a tighter bound of its own comes first
            "[server]\nshutdown_grace_s = 1e16\n",
            "[server] shutdown_grace_s: Input should be less than or equal to 86400",
        ),
    ],
)
def test_an_absurd_duration_in_the_file_names_its_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == f"{path}: {message}"


def test_the_longest_duration_is_taken() -> None:
    config = parse_config({"streams": {"resume_ttl_s": 1e9}, "server": {"retry_ms": 10**12}})
    assert (config.streams.resume_ttl_s, config.server.retry_ms) == (1e9, 10**12)


@pytest.mark.parametrize(
    ("table", "key", "value", "least"),
    [
        ("limits", "stream_lease_s", 0.001, "0.5"),
        ("server", "heartbeat_interval_s", 0.0001, "0.01"),
        ("cache", "ff_divisor", 1e-300, "1"),
    ],
)
def test_durations_too_short_to_work_are_config_errors(
    table: str, key: str, value: float, least: str
) -> None:
    """A lease of 1 ms let four streams of a key limited to one run (it ran out as it was
    renewed); pings every 0.1 ms took a core; a replay 1e300 times slower never ended."""
    error = config_error({table: {key: value}})
    assert (
        error == f"config.toml: [{table}] {key}: Input should be greater than or equal to {least}"
    )

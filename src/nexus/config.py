"""``config.toml``: pydantic models of every table, and :func:`load_config`.

Every key has a default (docs/configuration.md lists them with their
meaning); an unknown key is an error, so a typo is never silently ignored.
Errors name the file, the key and what is wrong::

    config.toml: [server] heartbeat_interval_s: Input should be greater than or equal to 0.01
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from .config_errors import describe
from .config_types import PER_MTOK, PROVIDER_NAME, URL, USD, BaseURL, ModelName, Origin, model_name
from .config_types import Table as _Table
from .config_types import env_name as _env_name
from .errors import ConfigError
from .hook_calls import HOOK_TIMEOUT_S
from .pricing import Price, PriceTable
from .protocol.anthropic_betas import Beta, default_betas
from .protocol.sse import MAX_EVENT_BYTES

__all__ = [
    "AnthropicProviderConfig",
    "AuthConfig",
    "AuthKeyConfig",
    "CacheConfig",
    "Config",
    "CorsConfig",
    "HTTPProviderConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MemoryStoreConfig",
    "MetricsConfig",
    "MockProviderConfig",
    "ModelAliasConfig",
    "OpenAIProviderConfig",
    "PluginConfig",
    "ProviderConfig",
    "RealtimeConfig",
    "RedisStoreConfig",
    "ServerConfig",
    "StoreConfig",
    "StreamsConfig",
    "TelemetryConfig",
    "load_config",
]


MAX_BACKLOG = 65535
"""The kernel takes an int, capped at ``net.core.somaxconn``: past 2**31 - 1, no listener."""
MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
"""The largest ``[realtime] max_message_bytes``: aiohttp keeps it in 32 bits (and a GiB is
far past what one socket should parse)."""


class ServerConfig(_Table):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    heartbeat_interval_s: float = Field(default=15.0, ge=0.01)  # (less: a core on pings)
    retry_ms: int = Field(default=3000, ge=0)
    shutdown_grace_s: float = Field(default=10.0, ge=0, le=86400)
    drain_delay_s: float = Field(default=0.0, ge=0, le=86400)
    write_timeout_s: float = Field(default=30.0, gt=0)
    uvloop: bool | Literal["auto"] = "auto"
    backlog: int = Field(default=2048, ge=1, le=MAX_BACKLOG)
    workers: int | Literal["auto"] = Field(default=1)
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    keepalive_timeout_s: float = Field(default=75.0, gt=0)
    max_connections: int = Field(default=20_000, ge=1)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_count(cls, value: object) -> object:
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(f'expected a number of workers (1 or more) or "auto", not {value!r}')

    @field_validator("uvloop", mode="before")
    @classmethod
    def _uvloop_choice(cls, value: object) -> object:
        if value == "auto" or type(value) is bool:
            return value
        raise ValueError(f'expected true, false or "auto", not {value!r}')


class LimitsConfig(_Table):
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    max_concurrent_streams: int = Field(default=10_000, ge=1)
    max_concurrent_streams_per_key: int = Field(default=100, ge=1)
    max_readers_per_key: int = Field(default=32, ge=1)
    """HTTP readers holding no stream slot (followers, resumes, joins) one key may run at
    once: per process with the memory store, over all replicas with Redis (key_readers)."""
    requests_per_second_per_key: float = Field(default=50.0, ge=0)
    max_stream_duration_s: float = Field(default=900.0, gt=0)
    stream_lease_s: float = Field(default=10.0, ge=0.5)  # (shorter: out as it is renewed)
    max_json_depth: int = Field(default=64, ge=1, le=200)
    """At most 200: stored or forwarded, a request nests deeper, and orjson stops at 254."""
    max_json_items: int = Field(default=100_000, ge=1)
    """Values a request's objects and arrays may hold (see :mod:`nexus.protocol.json_depth`)."""
    budget_max_output_tokens: int = Field(default=16_384, ge=1)
    """The output cap a request of a key with a budget is sent with when it sets none, so
    that its worst case, which the budget holds while it runs, is known."""


class AuthKeyConfig(_Table):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@:-]+$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    models: list[str] | None = None
    budget_usd: USD
    budget_period: Literal["day", "month", "total"] = "month"


class AuthConfig(_Table):
    keys: list[AuthKeyConfig] = Field(default_factory=list)
    allow_unauthenticated: bool = False
    token_secret_env: str = Field(
        default="NEXUS_TOKEN_SECRET", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128
    )

    @field_validator("keys")
    @classmethod
    def _unique(cls, value: list[AuthKeyConfig]) -> list[AuthKeyConfig]:
        names = [key.name for key in value]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"key name {name!r} is used twice")
        if len({key.sha256 for key in value}) != len(value):
            raise ValueError("two keys have the same sha256")
        return value


class CorsConfig(_Table):
    allow_origins: list[Origin] = Field(default_factory=list)
    max_age_s: int = Field(default=600, ge=0)


class PluginConfig(_Table):
    path: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    """``"module:attr"``: a plugin object, or a class / factory called with ``options``."""
    options: dict[str, Any] = Field(default_factory=dict)
    chunk_every: int = Field(default=1, ge=1)
    """Call ``on_chunk_received`` for every Nth chunk of a stream."""
    timeout_s: float = Field(default=HOOK_TIMEOUT_S, gt=0)
    """How long one of its hook calls may take; then it is abandoned (a hook error): a
    hung end hook held the key's stream slot, and the stream's end, forever."""


class LoggingConfig(_Table):
    format: Literal["text", "json"] = "text"
    access_log: bool = True


class MetricsConfig(_Table):
    enabled: bool = True
    token_env: str | None = None
    """The environment variable holding the bearer token ``/metrics`` asks for (it names
    every key and what each spent); unset, it answers no one on a gateway with keys or
    ``allow_unauthenticated``, and this machine only on a keyless one
    (:mod:`nexus.server.routes.metrics`)."""

    @field_validator("token_env")
    @classmethod
    def _names_a_variable(cls, value: str | None) -> str | None:
        return _env_name(value)


class TelemetryConfig(_Table):
    """OpenTelemetry traces (:mod:`nexus.telemetry`; needs ``nexus-gateway[otel]``)."""

    otlp_endpoint: str | None = Field(default=None, pattern=URL, max_length=2048)
    """The collector's OTLP/HTTP address (spans go to its ``/v1/traces``); unset: no tracing."""
    service_name: str = Field(default="nexus", min_length=1, max_length=256)
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """The share of new traces recorded; a request with a ``traceparent`` follows its caller."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value is not None and (
            "@" in value.split("://", 1)[1].split("/", 1)[0] or "?" in value or "#" in value
        ):
            raise ValueError(
                "no credentials, query or fragment in the URL (the exporter's log lines show "
                "it, and /v1/traces is added to its path): give credentials in the "
                "environment, OTEL_EXPORTER_OTLP_HEADERS"
            )
        return value


class StreamsConfig(_Table):
    detach_timeout_s: float = Field(default=15.0, ge=0)
    resume_ttl_s: float = Field(default=300.0, gt=0)
    max_log_bytes: int = Field(default=32 * 1024 * 1024, gt=0)


class CacheConfig(_Table):
    enabled: bool = False
    ttl_s: float = Field(default=600.0, gt=0)
    max_frames: int = Field(default=4096, ge=1)
    max_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    mode: Literal["burst", "paced", "fast_forward"] = "burst"
    ff_divisor: float = Field(default=4.0, ge=1)  # (fast forward: never slower than paced)
    share_across_keys: bool = False
    """Off: each API key has its own cache (a shared one tells a key what another asked,
    and hands it the other's answer and usage)."""


class MemoryStoreConfig(_Table):
    kind: Literal["memory"] = "memory"
    max_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    max_bytes_per_key: int = Field(default=64 * 1024 * 1024, gt=0)
    """What one API key's finished logs and recordings may hold of ``max_bytes``: past it,
    its own oldest go first, never another key's."""


class RedisStoreConfig(_Table):
    kind: Literal["redis"]
    url: str = Field(default="redis://127.0.0.1:6379/0", pattern=r"^(redis|rediss|unix)://\S+$")
    prefix: str = Field(default="nexus", min_length=1)
    max_connections: int = Field(default=128, ge=1)
    pool_timeout_s: float = Field(default=5.0, gt=0)
    required: bool = True
    max_bytes_per_key: int = Field(default=64 * 1024 * 1024, gt=0)
    """What one API key's logs and recordings may hold in Redis, counted by every replica
    alike: past it, its own finished ones nearest their expiry go (nexus.cache.redis_quota)."""
    mirror_interval_ms: int = Field(default=10, ge=1, le=1000)
    """How often the live logs are written to Redis: how late a reader on another replica
    may be, against Redis's CPU (25 ms took a third off it under 200 streams at 20 ms a
    token, bench/README.md)."""

    @field_validator("url")
    @classmethod
    def _parses(cls, url: str) -> str:
        from .cache.redis_url import check_url  # (imports the client: only when used)

        return check_url(url)


StoreConfig = Annotated[MemoryStoreConfig | RedisStoreConfig, Field(discriminator="kind")]


class RealtimeConfig(_Table):
    max_message_bytes: int = Field(default=16 * 1024 * 1024, gt=0, le=MAX_MESSAGE_BYTES)
    max_pending_input_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    max_pending_bytes_per_key: int = Field(default=256 * 1024 * 1024, gt=0)
    """Pending input of all a key's connections together: what it can pin in memory."""
    max_frames_per_second: int = Field(default=200, ge=1)
    """Frames (pings included) one socket may send a second, a second's worth at once; past
    it the socket is closed 1008. Every frame costs the event loop a parse and an answer."""
    max_bytes_per_second: int = Field(default=8 * 1024 * 1024, ge=1)
    """Message bytes one socket may send a second, sustained; at once, up to the larger of
    ``max_message_bytes`` and ``max_pending_input_bytes`` (all a socket may hold pending).
    Past it the socket is closed 1008. Bounds what parsing a socket's frames costs the loop."""
    max_sockets_per_key: int = Field(default=16, ge=1)
    """Realtime sockets one key may hold open: in this process with the memory store, on
    every replica together with Redis. Without a cap one key could take every place of
    ``[server] max_connections`` with idle sockets."""
    max_invalid_frames: int = Field(default=16, ge=1)
    """Frames in a row answered only with an error before the socket is closed 1008: each
    answer is larger than the frame that asked for it."""
    compression: bool = False
    """Accept permessage-deflate. Off by default: aiohttp inflates a message in one go,
    so a few KiB of deflated zeros would hold the event loop for every tenant while it
    grows to ``max_message_bytes``."""


class MockProviderConfig(_Table):
    kind: Literal["mock"]
    models: list[ModelName] = Field(default_factory=list)


class HTTPProviderConfig(_Table):
    """What the HTTP provider kinds share."""

    base_url: BaseURL
    api_key_env: str | None = None
    models: list[ModelName] = Field(default_factory=list)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    first_byte_timeout_s: float = Field(default=60.0, gt=0)
    idle_timeout_s: float = Field(default=60.0, gt=0)
    max_connections: int = Field(default=10_000, ge=0)
    """Unset, ``[limits] max_concurrent_streams`` (set by :class:`Config`): a stream holds a
    connection to its end, and a pool smaller than the streams allowed queues them. 0: none."""
    pool_timeout_s: float = Field(default=10.0, ge=0)
    ca_file: str | None = Field(default=None, min_length=1)
    """PEM file of the CA certificates an ``https`` upstream's certificate must chain to,
    instead of the system's trust store (a self-hosted upstream with a private CA)."""
    max_event_bytes: int = Field(default=MAX_EVENT_BYTES, ge=1024)
    """The most one upstream SSE event (or line) may hold before its end: past it, the
    stream ends with ``upstream_protocol_error`` instead of the gateway's memory growing."""
    optional: bool = False

    @field_validator("api_key_env")
    @classmethod
    def _names_a_variable(cls, value: str | None) -> str | None:
        return _env_name(value)


class OpenAIProviderConfig(HTTPProviderConfig):
    kind: Literal["openai"] = "openai"  # (required in a config file's table)
    base_url: BaseURL = "https://api.openai.com/v1"
    token_limit_field: Literal["max_tokens", "max_completion_tokens"] | None = None
    api_key_header: Literal["authorization", "api-key"] = "authorization"  # api-key: Azure's


class AnthropicProviderConfig(HTTPProviderConfig):
    kind: Literal["anthropic"] = "anthropic"
    base_url: BaseURL = "https://api.anthropic.com"
    anthropic_version: str = Field(default="2023-06-01", min_length=1, max_length=64)
    default_max_tokens: int = Field(default=4096, ge=1)
    betas: list[Beta] = Field(default_factory=default_betas)  # (see protocol.anthropic_betas)


ProviderConfig = Annotated[
    MockProviderConfig | OpenAIProviderConfig | AnthropicProviderConfig,
    Field(discriminator="kind"),
]


class ModelAliasConfig(_Table):
    """``[models."<name>"]``: an alias (``targets``, and optionally its prices) when the
    name has no ``/``; the prices of one ``<provider>/<model>`` (no ``targets``) when it
    has one. Prices are USD per million tokens (see :mod:`nexus.pricing`)."""

    targets: list[str] | None = None
    input_usd_per_mtok: PER_MTOK
    output_usd_per_mtok: PER_MTOK
    cached_input_usd_per_mtok: PER_MTOK
    """Unset: the input price."""
    cache_write_usd_per_mtok: PER_MTOK
    """Prompt tokens written to a prompt cache (Anthropic: 1.25x input). Unset: the input price."""
    cache_write_1h_usd_per_mtok: PER_MTOK
    """Those written for an hour (``"ttl": "1h"``). Unset: twice the input price, Anthropic's."""
    audio_input_usd_per_mtok: PER_MTOK
    """Prompt tokens of audio. Unset: the input price; a budget is refused audio input."""
    audio_output_usd_per_mtok: PER_MTOK
    """Completion tokens of audio. Unset: the output price; a budget is refused audio output."""

    @property
    def priced(self) -> bool:
        return self.input_usd_per_mtok is not None or self.output_usd_per_mtok is not None

    def price(self) -> Price | None:
        """Its prices, or None when it sets none."""
        if not self.priced:
            return None
        given = self.input_usd_per_mtok or 0.0
        cached = self.cached_input_usd_per_mtok
        return Price(
            given,
            self.output_usd_per_mtok or 0.0,
            given if cached is None else cached,
            self.cache_write_usd_per_mtok,
            self.audio_input_usd_per_mtok,
            self.audio_output_usd_per_mtok,
            self.cache_write_1h_usd_per_mtok,
        )


def _default_providers() -> dict[str, ProviderConfig]:
    return {"mock": MockProviderConfig(kind="mock", models=["echo"])}


class Config(_Table):
    server: ServerConfig = Field(default_factory=ServerConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    encoders: dict[str, str] = Field(default_factory=dict)
    realtime: RealtimeConfig = Field(default_factory=RealtimeConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    cors: CorsConfig = Field(default_factory=CorsConfig)
    plugins: list[PluginConfig] = Field(default_factory=list)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    streams: StreamsConfig = Field(default_factory=StreamsConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    store: StoreConfig = Field(default_factory=MemoryStoreConfig)
    providers: dict[str, ProviderConfig] = Field(default_factory=lambda: _default_providers())
    models: dict[str, ModelAliasConfig] = Field(default_factory=dict)

    @field_validator("providers")
    @classmethod
    def _provider_names(cls, value: dict[str, ProviderConfig]) -> dict[str, ProviderConfig]:
        if not value:
            raise ValueError("at least one provider is required")
        for name in value:
            if not PROVIDER_NAME.fullmatch(name):
                raise ValueError(
                    f"provider name {name!r} must be 1 to 64 characters, without '/', '*', "
                    "spaces or control characters"
                )
        return value

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: dict[str, ModelAliasConfig]) -> dict[str, ModelAliasConfig]:
        for name in value:
            model_name(name)
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _memory_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "kind" not in value:
            return {**value, "kind": "memory"}
        return value

    @model_validator(mode="after")
    def _pools_fit_the_streams(self) -> Config:
        """A provider's ``max_connections`` left unset: as many as the streams allowed (and
        still unset: a config rebuilt from these providers follows its own limit)."""
        for name, cfg in self.providers.items():
            if (
                isinstance(cfg, HTTPProviderConfig)
                and "max_connections" not in cfg.model_fields_set
            ):
                streams = self.limits.max_concurrent_streams
                followed = cfg.model_copy(update={"max_connections": streams})
                followed.model_fields_set.discard("max_connections")
                self.providers[name] = followed
        return self

    @model_validator(mode="after")
    def _targets_exist(self) -> Config:
        for alias, cfg in self.models.items():
            where = f'[models."{alias}"]'
            given = (cfg.input_usd_per_mtok, cfg.output_usd_per_mtok)
            others = (
                cfg.cached_input_usd_per_mtok,
                cfg.cache_write_usd_per_mtok,
                cfg.cache_write_1h_usd_per_mtok,
                cfg.audio_input_usd_per_mtok,
                cfg.audio_output_usd_per_mtok,
            )
            if None in given and (given != (None, None) or others != (None,) * len(others)):
                raise ValueError(
                    f"{where}: prices need both input_usd_per_mtok and output_usd_per_mtok"
                )
            if "/" in alias:
                provider, _, model = alias.partition("/")
                if cfg.targets is not None:
                    raise ValueError(
                        f"{where} targets: a '<provider>/<model>' entry holds prices only; "
                        "an alias name has no '/'"
                    )
                if not model or provider not in self.providers:
                    raise ValueError(
                        f"{where}: a name with '/' must be '<provider>/<model>' with a "
                        f"provider among {sorted(self.providers)}"
                    )
                if not cfg.priced:
                    raise ValueError(f"{where}: set input_usd_per_mtok and output_usd_per_mtok")
                continue
            if cfg.targets is None:
                raise ValueError(f"{where} targets: required key is missing")
            if not cfg.targets:
                raise ValueError(f"{where} targets: an alias needs at least one target")
            for target in cfg.targets:
                name, slash, model = target.partition("/")
                if not slash or not model or name not in self.providers:
                    raise ValueError(
                        f'[models."{alias}"] targets: {target!r} must be '
                        f"'<provider>/<model>' with a provider among {sorted(self.providers)}"
                    )
        return self


def price_table(config: Config) -> PriceTable:
    """The prices ``[models."<name>"]`` set, by alias or ``provider/model``."""
    prices = {name: cfg.price() for name, cfg in config.models.items()}
    return PriceTable({name: price for name, price in prices.items() if price is not None})


def load_config(path: str | Path) -> Config:
    """Read and validate a config file. Raises :class:`ConfigError`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(data, str(path))


def parse_config(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        raise ConfigError(f"{source}: {describe(error)}") from None

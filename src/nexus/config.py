"""``config.toml``: pydantic models of every table, and :func:`load_config`.

Every key has a default (the README's reference lists them); a key the loader
does not know is an error, so a typo is never silently ignored. Errors name
the file, the key and what is wrong::

    config.toml: [server] heartbeat_interval_s: Input should be greater than 0
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError
from .pricing import Price, PriceTable

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


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ServerConfig(_Table):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    heartbeat_interval_s: float = Field(default=15.0, gt=0)
    retry_ms: int = Field(default=3000, ge=0)
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    write_timeout_s: float = Field(default=30.0, gt=0)
    uvloop: bool | Literal["auto"] = "auto"
    """``auto``: uvloop when it is installed; ``true``: required; ``false``: asyncio's loop."""
    backlog: int = Field(default=2048, ge=1)
    """Connections the kernel queues before the gateway accepts them (capped by somaxconn)."""
    workers: int | Literal["auto"] = Field(default=1)
    """Worker processes on the port (``auto``: one per core); see :mod:`nexus.supervisor`."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A connection must deliver a complete request head this long after it connects
    (or after the first byte of a next request on a keep-alive connection); else it is
    closed. See :mod:`nexus.server.connection`."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """A request whose body takes no byte for this long (between two reads) is answered
    ``408 request_timeout`` and its connection closed."""
    keepalive_timeout_s: float = Field(default=75.0, gt=0)
    """An idle keep-alive connection (no byte since its last response) is closed after this."""
    max_connections: int = Field(default=20_000, ge=1)
    """Open connections per process (per worker with ``workers``); one more gets a 503."""

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_count(cls, value: object) -> object:
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(f'expected a number of workers (1 or more) or "auto", not {value!r}')


class LimitsConfig(_Table):
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    max_concurrent_streams: int = Field(default=10_000, ge=1)
    max_concurrent_streams_per_key: int = Field(default=100, ge=1)
    requests_per_second_per_key: float = Field(default=50.0, ge=0)
    """Sustained rate per API key (bursts up to one second's worth); 0 turns it off."""
    max_stream_duration_s: float = Field(default=900.0, gt=0)
    stream_lease_s: float = Field(default=10.0, gt=0)
    """With ``[store] kind = "redis"``: how long a concurrent-stream slot stays counted
    after its replica stopped renewing it (a replica that died); renewed every third of
    that while the stream runs."""
    max_json_depth: int = Field(default=64, ge=1, le=200)
    """How deep a request body's JSON may nest (objects and arrays); deeper: 400. At most
    200: the gateway nests a request a level or two further when it stores or forwards
    it, and the JSON encoder stops at 254."""


class AuthKeyConfig(_Table):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@:-]+$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """The SHA-256 of the key, hex (``nexus hash-key`` prints it); never the key itself."""
    models: list[str] | None = None
    """Model ids this key may call (``*`` wildcards: ``"mock/*"``); unset: every model."""
    budget_usd: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """What the key may spend per ``budget_period`` (the requests' ``cost_usd``, estimates
    included); past it, requests get ``429 budget_exceeded``. Unset: no budget."""
    budget_period: Literal["day", "month", "total"] = "month"
    """The budget's window: a UTC calendar day or month, or the key's whole life."""

    @field_validator("budget_usd", mode="before")
    @classmethod
    def _usd(cls, value: object) -> object:
        # TOML writes 5 for 5.0: a whole number of dollars is a budget too.
        return float(value) if type(value) is int else value


class AuthConfig(_Table):
    keys: list[AuthKeyConfig] = Field(default_factory=list)
    allow_unauthenticated: bool = False
    """Serving without keys is meant: on a non-loopback interface (refused otherwise), and
    to any ``Host`` name (otherwise a keyless gateway answers loopback names only)."""
    token_secret_env: str = Field(
        default="NEXUS_TOKEN_SECRET", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128
    )
    """The NAME of the environment variable holding the secret that signs read tokens
    (see :mod:`nexus.tokens`); the same value on every replica. Unset or empty: each
    process makes its own (``nexus serve --workers N`` makes one for all its workers)."""

    @field_validator("keys")
    @classmethod
    def _unique(cls, value: list[AuthKeyConfig]) -> list[AuthKeyConfig]:
        names = [key.name for key in value]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"key name {name!r} is used twice")
        hashes = [key.sha256 for key in value]
        if len(set(hashes)) != len(hashes):
            raise ValueError("two keys have the same sha256")
        return value


class CorsConfig(_Table):
    allow_origins: list[str] = Field(default_factory=list)
    """Origins whose pages may call the API (``"*"``: any); empty: same origin only."""
    max_age_s: int = Field(default=600, ge=0)


class PluginConfig(_Table):
    path: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    """``"module:attr"``: a plugin object, or a class / factory called with ``options``."""
    options: dict[str, Any] = Field(default_factory=dict)
    chunk_every: int = Field(default=1, ge=1)
    """Call ``on_chunk_received`` for every Nth chunk of a stream."""


class LoggingConfig(_Table):
    format: Literal["text", "json"] = "text"
    """``json``: one JSON object per line, with the request id."""
    access_log: bool = True
    """One line per request: method, path, endpoint, status, outcome, model asked and served,
    key name, client address, TTFB, TTFT, duration, events and bytes of a written stream,
    tokens and cost (see :mod:`nexus.server.access`)."""


class MetricsConfig(_Table):
    enabled: bool = True
    """Prometheus text format at ``GET /metrics``."""


class TelemetryConfig(_Table):
    """OpenTelemetry traces (:mod:`nexus.telemetry`; needs ``nexus-gateway[otel]``)."""

    otlp_endpoint: str | None = Field(default=None, pattern=r"^https?://\S+$", max_length=2048)
    """The collector's OTLP/HTTP address (``http://127.0.0.1:4318``: spans go to its
    ``/v1/traces``). Unset: no tracing at all."""
    service_name: str = Field(default="nexus", min_length=1, max_length=256)
    """The ``service.name`` of the spans' resource."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """The share of new traces recorded; a request that comes with a ``traceparent``
    follows its caller's decision (parent-based sampling)."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value is not None and "@" in value.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "no credentials in the URL (the exporter's log lines show it): give them in "
                "the environment, OTEL_EXPORTER_OTLP_HEADERS"
            )
        return value


class StreamsConfig(_Table):
    """Stream resources: how long they outlive their connections."""

    detach_timeout_s: float = Field(default=15.0, ge=0)
    """With no client attached, a resumable stream (background, or asked for) runs this
    long, then is cancelled; any other stream is cancelled as its last client leaves."""
    resume_ttl_s: float = Field(default=300.0, gt=0)
    """A finished stream stays replayable (``GET /v1/streams/{id}``) this long."""
    max_log_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    """A stream whose log grows past this ends with ``stream_too_large``."""


class CacheConfig(_Table):
    """Record-and-replay of whole streams, keyed by the canonical request."""

    enabled: bool = False
    ttl_s: float = Field(default=600.0, gt=0)
    max_frames: int = Field(default=4096, ge=1)
    max_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    mode: Literal["burst", "paced", "fast_forward"] = "burst"
    ff_divisor: float = Field(default=4.0, gt=0)
    share_across_keys: bool = False
    """Replay one key's recordings to, and join its in-flight streams with, another key's
    identical requests. Off: each API key has its own cache (a shared one tells a key what
    another asked, and hands it the other's answer and usage)."""


class MemoryStoreConfig(_Table):
    kind: Literal["memory"] = "memory"
    max_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    """Finished stream logs and recordings past this are evicted, oldest first."""


class RedisStoreConfig(_Table):
    kind: Literal["redis"]
    url: str = Field(default="redis://127.0.0.1:6379/0", pattern=r"^(redis|rediss|unix)://\S+$")
    prefix: str = Field(default="nexus", min_length=1)
    """Key prefix: replicas that share streams share it."""
    max_connections: int = Field(default=128, ge=1)
    """Connections to Redis from this process. Commands hold one for a round trip; a
    client following a stream that runs on another replica holds one while its read
    blocks (up to 1.5 s at a time)."""
    pool_timeout_s: float = Field(default=5.0, gt=0)
    """How long a request may wait for a free connection, then 503 ``store_unavailable``."""
    required: bool = True
    """Whether a new stream needs Redis. True: one that cannot be begun there is refused
    (503 ``store_unavailable``). False: it runs on this replica only (``X-Nexus-Store:
    unavailable``): not cached, not joined, resumable elsewhere only once its mirror caught
    up. Streams already running keep streaming to their clients either way."""


StoreConfig = Annotated[MemoryStoreConfig | RedisStoreConfig, Field(discriminator="kind")]


class RealtimeConfig(_Table):
    max_message_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    max_pending_input_bytes: int = Field(default=32 * 1024 * 1024, gt=0)


class MockProviderConfig(_Table):
    kind: Literal["mock"]
    models: list[str] = Field(default_factory=list)


class HTTPProviderConfig(_Table):
    """What the HTTP provider kinds share."""

    base_url: str = Field(pattern=r"^https?://\S+$")
    api_key_env: str | None = None
    models: list[str] = Field(default_factory=list)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    first_byte_timeout_s: float = Field(default=60.0, gt=0)
    idle_timeout_s: float = Field(default=60.0, gt=0)
    max_connections: int = Field(default=10_000, ge=0)
    """Upstream connections at once (0: no limit): a stream holds one for its whole
    length, so this is also the most streams in flight to this provider. The default is
    ``[limits] max_concurrent_streams``' default, so the gateway's own limit is the one
    met first; a lower one protects an upstream with a limit of its own."""
    pool_timeout_s: float = Field(default=10.0, ge=0)
    """How long a request may wait for a free connection of the pool, then 503
    ``upstream_pool_exhausted`` (the next target of an alias is tried). Not part of
    ``first_byte_timeout_s``."""
    optional: bool = False


class OpenAIProviderConfig(HTTPProviderConfig):
    kind: Literal["openai"]
    base_url: str = Field(default="https://api.openai.com/v1", pattern=r"^https?://\S+$")
    token_limit_field: Literal["max_tokens", "max_completion_tokens"] | None = None
    """Send the token limit under this name (OpenAI's reasoning models refuse max_tokens);
    unset: as the request has it."""


class AnthropicProviderConfig(HTTPProviderConfig):
    kind: Literal["anthropic"]
    base_url: str = Field(default="https://api.anthropic.com", pattern=r"^https?://\S+$")
    anthropic_version: str = "2023-06-01"
    default_max_tokens: int = Field(default=4096, ge=1)


ProviderConfig = Annotated[
    MockProviderConfig | OpenAIProviderConfig | AnthropicProviderConfig,
    Field(discriminator="kind"),
]


class ModelAliasConfig(_Table):
    """``[models."<name>"]``: an alias (``targets``, and optionally its prices) when the
    name has no ``/``; the prices of one ``<provider>/<model>`` (no ``targets``) when it
    has one. Prices are USD per million tokens (see :mod:`nexus.pricing`)."""

    targets: list[str] | None = None
    input_usd_per_mtok: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    output_usd_per_mtok: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    cached_input_usd_per_mtok: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Unset: the input price."""

    @field_validator(
        "input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok", mode="before"
    )
    @classmethod
    def _number(cls, value: object) -> object:
        if type(value) is int:  # strict mode takes no int for a float: ``= 3`` is meant
            return float(value)
        return value

    @property
    def priced(self) -> bool:
        return self.input_usd_per_mtok is not None or self.output_usd_per_mtok is not None

    def price(self) -> Price | None:
        """Its prices, or None when it sets none."""
        if not self.priced:
            return None
        given = self.input_usd_per_mtok or 0.0
        cached = self.cached_input_usd_per_mtok
        return Price(given, self.output_usd_per_mtok or 0.0, given if cached is None else cached)


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
            if not name or "/" in name:
                raise ValueError(f"provider name {name!r} must be non-empty and without '/'")
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _memory_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "kind" not in value:
            return {**value, "kind": "memory"}
        return value

    @model_validator(mode="after")
    def _targets_exist(self) -> Config:
        for alias, cfg in self.models.items():
            where = f'[models."{alias}"]'
            given = (cfg.input_usd_per_mtok, cfg.output_usd_per_mtok)
            if (None in given and given != (None, None)) or (
                cfg.cached_input_usd_per_mtok is not None and None in given
            ):
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
        raise ConfigError(f"{source}: {_describe(error)}") from None


_KINDS = ("mock", "openai", "anthropic")
_STORE_KINDS = ("memory", "redis")


def _describe(error: Any) -> str:
    loc = [str(p) for p in error["loc"]]
    message = str(error["msg"])
    if error["type"] == "union_tag_not_found":
        loc, message = [*loc, "kind"], "required key is missing"
    elif error["type"] == "union_tag_invalid":
        ctx = error.get("ctx", {})
        loc = [*loc, "kind"]
        message = f"unknown kind {ctx.get('tag')!r} (expected {ctx.get('expected_tags')})"
    if error["type"] == "extra_forbidden":
        message = "unknown key (check the spelling against the README's config reference)"
    elif error["type"] == "missing":
        message = "required key is missing"
    elif message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if not loc:
        return message
    if len(loc) == 1:
        return (
            f"{loc[0]}: {message}"
            if error["type"] != "extra_forbidden"
            else (f"[{loc[0]}]: unknown table or key")
        )
    table, rest = loc[0], loc[1:]
    if table == "plugins" and rest and rest[0].isdigit():
        where = f"[[plugins]] #{int(rest[0]) + 1}"
        return f"{where} {'.'.join(rest[1:])}: {message}" if rest[1:] else f"{where}: {message}"
    if table == "auth" and len(rest) >= 2 and rest[0] == "keys" and rest[1].isdigit():
        where = f"[[auth.keys]] #{int(rest[1]) + 1}"
        return f"{where} {'.'.join(rest[2:])}: {message}" if rest[2:] else f"{where}: {message}"
    if table == "store" and rest and rest[0] in _STORE_KINDS:
        rest = rest[1:]  # the discriminator tag again
        if not rest:
            return f"[store]: {message}"
    if table == "providers" and len(rest) >= 2 and rest[1] in _KINDS:
        rest = [rest[0], *rest[2:]]  # drop the discriminator tag pydantic adds
        if len(rest) == 1:
            return f"[providers.{rest[0]}]: {message}"
    if table in ("providers", "models") and len(rest) >= 2:
        name = rest[0] if table == "providers" and "." not in rest[0] else f'"{rest[0]}"'
        return f"[{table}.{name}] {'.'.join(rest[1:])}: {message}"
    return f"[{table}] {'.'.join(rest)}: {message}"

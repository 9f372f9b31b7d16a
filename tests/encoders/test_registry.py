"""The encoder registry: registration rules, freezing, copies, and ``[encoders]`` entries."""

from __future__ import annotations

from pathlib import Path

import pytest

import nexus.encoders.registry as registry_module
from nexus.encoders import (
    AnthropicSSEEncoder,
    Encoder,
    NativeSSEEncoder,
    NDJSONEncoder,
    OpenAISSEEncoder,
    ResponsesSSEEncoder,
)
from nexus.encoders.registry import EncoderRegistry, _defaults, default_registry, register
from nexus.errors import ConfigError, RegistryFrozen
from nexus.events import Delta, Done, Error, StreamEvent
from nexus.types import StreamMeta

CUSTOM = "application/x-custom"
NATIVE = "application/vnd.nexus.events+sse"


@pytest.fixture
def custom_module(monkeypatch: pytest.MonkeyPatch) -> type[Encoder]:
    """Make ``tests/custom_encoder.py`` importable as ``custom_encoder``."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    import custom_encoder

    return custom_encoder.CustomEncoder


def test_defaults() -> None:
    registry = _defaults()
    assert registry.media_types() == [
        "text/event-stream",
        "application/vnd.nexus.events+sse",
        "application/x-ndjson",
        "application/vnd.nexus.anthropic-messages+sse",
        "application/vnd.nexus.openai-responses+sse",
    ]
    assert [registry.get(m) for m in registry.media_types()] == [
        OpenAISSEEncoder,
        NativeSSEEncoder,
        NDJSONEncoder,
        AnthropicSSEEncoder,
        ResponsesSSEEncoder,
    ]
    assert registry.aliases_of("application/x-ndjson") == ["ndjson", "jsonl"]
    assert registry.describe() == (
        "text/event-stream (sse, openai), application/vnd.nexus.events+sse (nexus, nexus-sse), "
        "application/x-ndjson (ndjson, jsonl), "
        "application/vnd.nexus.anthropic-messages+sse (anthropic, messages), "
        "application/vnd.nexus.openai-responses+sse (responses, openai-responses)"
    )
    assert registry.frozen is False


def test_register_with_class_aliases(custom_module: type[Encoder]) -> None:
    registry = EncoderRegistry()
    registry.register(CUSTOM, custom_module)
    assert registry.media_types() == [CUSTOM]
    assert registry.get(CUSTOM) is custom_module
    assert registry.aliases_of(CUSTOM) == ["custom", "cust"]
    assert registry.describe() == "application/x-custom (custom, cust)"


def test_register_with_argument_aliases_replaces_class_aliases(
    custom_module: type[Encoder],
) -> None:
    registry = EncoderRegistry()
    registry.register(CUSTOM, custom_module, aliases=[" Mine "])
    assert registry.aliases_of(CUSTOM) == ["mine"]
    assert registry.resolve("mine") == CUSTOM
    assert registry.resolve("custom") is None
    import custom_encoder

    registry.register("application/x-other", custom_encoder.OtherEncoder, aliases=[])
    assert registry.aliases_of("application/x-other") == []
    assert registry.describe() == "application/x-custom (mine), application/x-other"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("custom", CUSTOM),
        ("CUSTOM", CUSTOM),
        ("  Cust\t", CUSTOM),
        ("application/x-custom", CUSTOM),
        ("Application/X-Custom", CUSTOM),
        ("x-custom", None),
        ("", None),
        ("application/*", None),
    ],
)
def test_resolve_is_case_insensitive(
    custom_module: type[Encoder], name: str, expected: str | None
) -> None:
    registry = EncoderRegistry()
    registry.register(CUSTOM, custom_module)
    assert registry.resolve(name) == expected


def test_media_type_is_stored_lowercase(custom_module: type[Encoder]) -> None:
    registry = EncoderRegistry()
    registry.register("  Application/X-Custom ", custom_module)
    assert registry.media_types() == [CUSTOM]
    assert registry.get(CUSTOM) is custom_module
    with pytest.raises(KeyError):
        registry.get("Application/X-Custom")


def test_register_again_replaces_the_encoder_and_keeps_its_aliases(
    custom_module: type[Encoder],
) -> None:
    import custom_encoder

    replacement = custom_encoder.NDJSONReplacement
    registry = _defaults()
    registry.register("application/x-ndjson", replacement, aliases=["ndjson"])
    assert registry.get("application/x-ndjson") is replacement
    assert registry.resolve("jsonl") == "application/x-ndjson"
    assert registry.media_types()[2] == "application/x-ndjson"  # keeps its place


@pytest.mark.parametrize(
    ("alias", "owner"),
    [("ndjson", "application/x-ndjson"), ("SSE", "text/event-stream"), (" nexus", NATIVE)],
)
def test_alias_conflict_raises_and_changes_nothing(
    custom_module: type[Encoder], alias: str, owner: str
) -> None:
    registry = _defaults()
    with pytest.raises(ValueError) as info:
        registry.register(CUSTOM, custom_module, aliases=["fine", alias])
    assert str(info.value) == f"alias {alias.strip().lower()!r} already names {owner!r}"
    assert registry.resolve(CUSTOM) is None
    assert registry.resolve("fine") is None
    assert registry.resolve(alias) == owner


@pytest.mark.parametrize("alias", ["", "  ", "a/b"])
def test_bad_alias_raises(custom_module: type[Encoder], alias: str) -> None:
    registry = EncoderRegistry()
    with pytest.raises(ValueError, match="must be a non-empty name without '/'"):
        registry.register(CUSTOM, custom_module, aliases=[alias])
    assert registry.media_types() == []


@pytest.mark.parametrize(
    "media_type",
    ["custom", "", "/x", "x/", "text/*", "*/*", "text/plain; charset=utf-8", "text/ plain"],
)
def test_bad_media_type_raises(custom_module: type[Encoder], media_type: str) -> None:
    registry = EncoderRegistry()
    with pytest.raises(ValueError) as info:
        registry.register(media_type, custom_module)
    assert str(info.value) == f"{media_type!r} is not a media type like 'type/subtype'"
    assert registry.media_types() == []


@pytest.mark.parametrize("obj", [object(), "custom_encoder:CustomEncoder", dict, Encoder.__init__])
def test_non_encoder_raises(obj: object) -> None:
    registry = EncoderRegistry()
    with pytest.raises(ValueError) as info:
        registry.register(CUSTOM, obj)  # type: ignore[arg-type]
    assert str(info.value) == f"{obj!r} is not a subclass of nexus.Encoder"
    assert registry.media_types() == []


class _Abstract(Encoder):
    media_type = CUSTOM  # and no encode()


class _NoMediaType(Encoder):
    def encode(self, event: StreamEvent) -> bytes:
        return b"x"


@pytest.mark.parametrize(
    ("encoder", "problem"),
    [
        (_Abstract, "_Abstract is abstract: it does not implement encode()"),
        (_NoMediaType, "_NoMediaType has no media_type (a class attribute)"),
    ],
)
def test_a_class_that_cannot_serve_is_refused_at_register(
    encoder: type[Encoder], problem: str
) -> None:
    registry = EncoderRegistry()
    with pytest.raises(ValueError) as info:
        registry.register(CUSTOM, encoder)
    assert str(info.value) == problem
    assert registry.media_types() == []


def test_an_encoder_is_registered_under_its_own_media_type_only(
    custom_module: type[Encoder],
) -> None:
    """The registered name is the one announced (the class's): they cannot differ."""
    registry = EncoderRegistry()
    with pytest.raises(ValueError) as info:
        registry.register("application/x-other", custom_module, aliases=["other"])
    assert str(info.value) == (
        "CustomEncoder has media_type 'application/x-custom', not 'application/x-other': an "
        "encoder is registered under its own media type (subclass it to serve it under another)"
    )
    assert registry.resolve("other") is None
    registry.register(" Application/X-Custom", custom_module)  # its own, in any case
    assert registry.get(CUSTOM) is custom_module


def test_load_config_names_the_key_of_an_encoder_that_cannot_serve(
    custom_module: type[Encoder],
) -> None:
    with pytest.raises(ConfigError) as info:
        EncoderRegistry().load_config({"text/plain": "custom_encoder:CustomEncoder"}, "n.toml")
    assert str(info.value).startswith(
        "n.toml: [encoders] 'text/plain': CustomEncoder has media_type 'application/x-custom'"
    )


def test_a_registry_with_builtins_starts_with_every_built_in_format() -> None:
    registry = EncoderRegistry(builtins=True)
    assert registry.describe() == _defaults().describe()
    assert [registry.get(m) for m in registry.media_types()] == [
        registry_module.default_registry.get(m) for m in registry.media_types()
    ]
    assert registry.frozen is False
    assert EncoderRegistry().media_types() == []


def test_encoder_instance_is_not_a_class(custom_module: type[Encoder]) -> None:
    instance = custom_module(StreamMeta(id="x", model="m", created=0))
    with pytest.raises(ValueError, match=r"is not a subclass of nexus\.Encoder"):
        EncoderRegistry().register(CUSTOM, instance)  # type: ignore[arg-type]


def test_freeze_then_register_raises(custom_module: type[Encoder]) -> None:
    registry = _defaults()
    registry.freeze()
    assert registry.frozen is True
    with pytest.raises(RegistryFrozen) as info:
        registry.register(CUSTOM, custom_module)
    assert str(info.value) == (
        "cannot register 'application/x-custom': the encoder registry is frozen because an app "
        "has started on it; register encoders before the app starts"
    )
    assert registry.resolve("custom") is None
    assert len(registry.media_types()) == len(_defaults().media_types())
    # Lookups still work once frozen.
    assert registry.resolve("jsonl") == "application/x-ndjson"


def test_copy_is_unfrozen_and_independent(custom_module: type[Encoder]) -> None:
    original = _defaults()
    original.freeze()
    copy = original.copy()
    assert copy.frozen is False
    assert copy.media_types() == original.media_types()
    assert copy.describe() == original.describe()
    copy.register(CUSTOM, custom_module)
    assert copy.resolve("custom") == CUSTOM
    assert original.resolve("custom") is None
    assert CUSTOM not in original.media_types()


def test_module_register_adds_to_the_default_registry(
    monkeypatch: pytest.MonkeyPatch, custom_module: type[Encoder]
) -> None:
    scratch = default_registry.copy()
    monkeypatch.setattr(registry_module, "default_registry", scratch)
    register(CUSTOM, custom_module, aliases=["mine"])
    assert scratch.resolve("MINE") == CUSTOM
    assert default_registry.resolve("mine") is None


def test_base_encoder_defaults(custom_module: type[Encoder]) -> None:
    encoder = custom_module(StreamMeta(id="x", model="m", created=0))
    assert encoder.start() == b""
    assert encoder.encode(Delta(content="x")) == b"delta\n"
    assert encoder.error(Error(error_type="t", message="m")) == b"error\n"
    assert encoder.end() == b"done\n"
    assert encoder.end() == encoder.encode(Done())
    assert custom_module.content_type is None


# --- [encoders] in config.toml -------------------------------------------------------------


@pytest.mark.parametrize("spec", ["custom_encoder:CustomEncoder", "custom_encoder:Holder.Encoder"])
def test_load_config_registers_the_named_class(custom_module: type[Encoder], spec: str) -> None:
    registry = _defaults()
    registry.load_config({"Application/X-Custom": spec})
    assert registry.get(CUSTOM) is custom_module
    assert registry.resolve("cust") == CUSTOM
    assert registry.media_types()[:-1] == _defaults().media_types()


def test_load_config_empty_changes_nothing() -> None:
    registry = _defaults()
    registry.load_config({})
    assert registry.describe() == _defaults().describe()


@pytest.mark.parametrize(
    ("media_type", "spec", "problem"),
    [
        (
            CUSTOM,
            "no_such_module_for_nexus_tests:Encoder",
            "cannot import module 'no_such_module_for_nexus_tests': "
            "No module named 'no_such_module_for_nexus_tests'",
        ),
        (
            CUSTOM,
            "custom_encoder:Missing",
            "module 'custom_encoder' has no attribute 'Missing'",
        ),
        (
            CUSTOM,
            "custom_encoder:Holder.Missing",
            "module 'custom_encoder' has no attribute 'Holder.Missing'",
        ),
        (CUSTOM, "custom_encoder", "'custom_encoder' must have the form 'module:attr'"),
        (CUSTOM, "custom_encoder:", "'custom_encoder:' must have the form 'module:attr'"),
        (CUSTOM, ":CustomEncoder", "':CustomEncoder' must have the form 'module:attr'"),
        (CUSTOM, "", "'' must have the form 'module:attr'"),
        (
            CUSTOM,
            "custom_encoder:NOT_AN_ENCODER",
            "'a string' is not a subclass of nexus.Encoder",
        ),
        (
            CUSTOM,
            "custom_encoder:PlainClass",
            "<class 'custom_encoder.PlainClass'> is not a subclass of nexus.Encoder",
        ),
        (
            "x-custom",
            "custom_encoder:CustomEncoder",
            "'x-custom' is not a media type like 'type/subtype'",
        ),
    ],
)
def test_load_config_errors_name_the_key(
    custom_module: type[Encoder], media_type: str, spec: str, problem: str
) -> None:
    registry = _defaults()
    with pytest.raises(ConfigError) as info:
        registry.load_config({media_type: spec}, source="nexus.toml")
    assert str(info.value) == f"nexus.toml: [encoders] {media_type!r}: {problem}"
    assert registry.resolve(CUSTOM) is None


def test_load_config_default_source_is_config_toml(custom_module: type[Encoder]) -> None:
    with pytest.raises(ConfigError) as info:
        _defaults().load_config({CUSTOM: "custom_encoder:Missing"})
    assert str(info.value).startswith("config.toml: [encoders] 'application/x-custom': ")


def test_load_config_alias_conflict_names_the_key(custom_module: type[Encoder]) -> None:
    registry = _defaults()
    registry.load_config({CUSTOM: "custom_encoder:CustomEncoder"}, "nexus.toml")
    with pytest.raises(ConfigError) as info:
        registry.load_config({"application/x-other": "custom_encoder:OtherEncoder"}, "nexus.toml")
    assert str(info.value) == (
        f"nexus.toml: [encoders] 'application/x-other': alias 'custom' already names {CUSTOM!r}"
    )
    assert registry.resolve("application/x-other") is None
    assert registry.resolve("cust") == CUSTOM


def test_load_config_on_a_frozen_registry_raises_registry_frozen(
    custom_module: type[Encoder],
) -> None:
    registry = _defaults()
    registry.freeze()
    with pytest.raises(RegistryFrozen, match="frozen because an app has started"):
        registry.load_config({CUSTOM: "custom_encoder:CustomEncoder"})
    assert registry.resolve(CUSTOM) is None

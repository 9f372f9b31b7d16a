"""The encoder registry: a dict of media type -> encoder class, plus aliases.

It is open for registration until an app starts on it, then frozen
(registering later raises :class:`~nexus.errors.RegistryFrozen`): what a
running server negotiates never changes under it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Sequence

from ..errors import ConfigError, RegistryFrozen
from .base import Encoder

__all__ = ["EncoderRegistry", "default_registry", "load_object", "register"]


class EncoderRegistry:
    """Media types (and aliases) to encoder classes.

    ``EncoderRegistry(builtins=True)`` starts with the built-in formats (those every
    endpoint answers in by default); ``EncoderRegistry()`` starts empty.
    """

    def __init__(self, *, builtins: bool = False) -> None:
        self._encoders: dict[str, type[Encoder]] = {}
        self._aliases: dict[str, str] = {}
        self._frozen = False
        if builtins:
            for encoder in _builtins():
                self.register(encoder.media_type, encoder)

    def register(
        self,
        media_type: str,
        encoder: type[Encoder],
        aliases: Iterable[str] | None = None,
    ) -> None:
        """Add ``encoder`` for ``media_type`` (replacing any encoder already there).

        ``media_type`` must be the class's own ``media_type``: it is the name the
        format is negotiated by and announced under (``X-Nexus-Stream-Format``),
        so one class cannot answer to two; subclass it to serve it under another.
        ``aliases`` default to ``encoder.aliases``. Raises ``ValueError`` for a
        malformed media type, a class that is not a concrete :class:`Encoder` of
        that media type, or an alias that already names another media type;
        :class:`RegistryFrozen` once an app has started on this registry.
        """
        if self._frozen:
            raise RegistryFrozen(
                f"cannot register {media_type!r}: the encoder registry is frozen because an app "
                "has started on it; register encoders before the app starts"
            )
        key = media_type.strip().lower()
        main, slash, sub = key.partition("/")
        if not slash or not main or not sub or "*" in key or ";" in key or " " in key:
            raise ValueError(f"{media_type!r} is not a media type like 'type/subtype'")
        _check_encoder(encoder, key)
        names = [a.strip().lower() for a in (encoder.aliases if aliases is None else aliases)]
        for alias in names:
            if not alias or "/" in alias:
                raise ValueError(f"alias {alias!r} must be a non-empty name without '/'")
            owner = self._aliases.get(alias)
            if owner is not None and owner != key:
                raise ValueError(f"alias {alias!r} already names {owner!r}")
        self._encoders[key] = encoder
        for alias in names:
            self._aliases[alias] = key

    def resolve(self, name: str) -> str | None:
        key = name.strip().lower()
        if key in self._encoders:
            return key
        return self._aliases.get(key)

    def get(self, media_type: str) -> type[Encoder]:
        return self._encoders[media_type]

    def content_type(self, media_type: str) -> str:
        encoder = self._encoders[media_type]
        return encoder.content_type or encoder.media_type

    def media_types(self) -> Sequence[str]:
        return list(self._encoders)

    def aliases_of(self, media_type: str) -> list[str]:
        return [alias for alias, owner in self._aliases.items() if owner == media_type]

    def describe(self) -> str:
        parts = []
        for media_type in self._encoders:
            aliases = self.aliases_of(media_type)
            parts.append(f"{media_type} ({', '.join(aliases)})" if aliases else media_type)
        return ", ".join(parts)

    def freeze(self) -> None:
        self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    def copy(self) -> EncoderRegistry:
        """An unfrozen copy with the same entries."""
        other = EncoderRegistry()
        other.include(self)
        return other

    def include(self, other: EncoderRegistry) -> None:
        """Add every entry of ``other`` (same rules as :meth:`register`)."""
        for media_type, encoder in other._encoders.items():
            self.register(media_type, encoder, other.aliases_of(media_type))

    def load_config(self, encoders: dict[str, str], source: str = "config.toml") -> None:
        """Register ``[encoders]`` entries (``"media/type" = "module:attr"``).

        Raises :class:`ConfigError` naming the key when an import fails or the
        object is not an encoder class.
        """
        for media_type, spec in encoders.items():
            where = f"{source}: [encoders] {media_type!r}"
            obj = load_object(spec, where)
            try:
                self.register(media_type, obj)  # type: ignore[arg-type]
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None


def _check_encoder(encoder: object, media_type: str) -> None:
    """Refuse, at registration, a class that would fail every request in its format."""
    if not (isinstance(encoder, type) and issubclass(encoder, Encoder)):
        raise ValueError(f"{encoder!r} is not a subclass of nexus.Encoder")
    if inspect.isabstract(encoder):
        missing = ", ".join(f"{name}()" for name in sorted(encoder.__abstractmethods__))
        raise ValueError(f"{encoder.__qualname__} is abstract: it does not implement {missing}")
    own = getattr(encoder, "media_type", None)
    if not isinstance(own, str):
        raise ValueError(f"{encoder.__qualname__} has no media_type (a class attribute)")
    if own.strip().lower() != media_type:
        raise ValueError(
            f"{encoder.__qualname__} has media_type {own!r}, not {media_type!r}: an encoder is "
            "registered under its own media type (subclass it to serve it under another)"
        )


def load_object(spec: str, where: str) -> object:
    """Import ``"module:attr"``; a :class:`ConfigError` naming ``where`` if it fails."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ConfigError(f"{where}: {spec!r} must have the form 'module:attr'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{where}: cannot import module {module_name!r}: {exc}") from None
    obj: object = module
    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise ConfigError(
                f"{where}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def _builtins() -> tuple[type[Encoder], ...]:
    """The built-in encoders, in the order ``describe()`` lists them."""
    from .anthropic_sse import AnthropicSSEEncoder
    from .native_sse import NativeSSEEncoder
    from .ndjson import NDJSONEncoder
    from .openai_sse import OpenAISSEEncoder
    from .responses_sse import ResponsesSSEEncoder

    return (
        OpenAISSEEncoder,
        NativeSSEEncoder,
        NDJSONEncoder,
        AnthropicSSEEncoder,
        ResponsesSSEEncoder,
    )


def _defaults() -> EncoderRegistry:
    return EncoderRegistry(builtins=True)


default_registry = _defaults()
"""The process-wide registry that :func:`register` adds to and apps copy at start-up."""


def register(media_type: str, encoder: type[Encoder], aliases: Iterable[str] | None = None) -> None:
    """Register an encoder in the default registry (see :meth:`EncoderRegistry.register`)."""
    default_registry.register(media_type, encoder, aliases)

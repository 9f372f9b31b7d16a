"""Stream encoders and the registry integrators extend."""

from .base import Encoder
from .native_sse import NativeSSEEncoder
from .ndjson import NDJSONEncoder
from .openai_sse import OpenAISSEEncoder
from .registry import EncoderRegistry, default_registry, register

__all__ = [
    "Encoder",
    "EncoderRegistry",
    "NDJSONEncoder",
    "NativeSSEEncoder",
    "OpenAISSEEncoder",
    "default_registry",
    "register",
]

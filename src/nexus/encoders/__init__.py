"""Stream encoders and the registry integrators extend."""

from .anthropic_sse import AnthropicSSEEncoder
from .base import Encoder
from .native_sse import NativeSSEEncoder
from .ndjson import NDJSONEncoder
from .openai_sse import OpenAISSEEncoder
from .registry import EncoderRegistry, default_registry, register
from .responses_sse import ResponsesSSEEncoder

__all__ = [
    "AnthropicSSEEncoder",
    "Encoder",
    "EncoderRegistry",
    "NDJSONEncoder",
    "NativeSSEEncoder",
    "OpenAISSEEncoder",
    "ResponsesSSEEncoder",
    "default_registry",
    "register",
]

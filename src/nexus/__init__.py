"""Nexus: a streaming gateway for large language models.

The public API for integrators; everything else is internal.
"""

__version__ = "0.1.0"  # (first: modules imported below name it, the User-Agent sent upstream)

from typing import TYPE_CHECKING

from .config import AnthropicProviderConfig, Config, OpenAIProviderConfig, load_config
from .encoders import Encoder, EncoderRegistry, register
from .engine import Engine
from .errors import (
    ConfigError,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NexusError,
    RegistryFrozen,
    StreamError,
    UpstreamError,
    UpstreamTimeout,
)
from .events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Heartbeat,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
)
from .hooks import CallContext, Hooks, Middleware, Next, StreamRejected, map_stream
from .pricing import Price, PriceTable, Spend
from .providers import AnthropicProvider, MockProvider, OpenAIProvider, Provider
from .request import ChatRequest
from .stream import Channel, EndOfStream, Stream, accumulate
from .types import CompletedToolCall, Completion, ReasoningBlock, StreamMeta

__all__ = [
    "AnthropicProvider",
    "AnthropicProviderConfig",
    "Audio",
    "CallContext",
    "Channel",
    "ChatRequest",
    "Citation",
    "CompletedToolCall",
    "Completion",
    "Config",
    "ConfigError",
    "Delta",
    "Done",
    "Encoder",
    "EncoderRegistry",
    "EndOfStream",
    "Engine",
    "Error",
    "GatewayError",
    "Heartbeat",
    "Hooks",
    "Image",
    "InvalidRequest",
    "Middleware",
    "MockProvider",
    "ModelNotFound",
    "Next",
    "NexusError",
    "OpenAIProvider",
    "OpenAIProviderConfig",
    "Price",
    "PriceTable",
    "Provider",
    "Reasoning",
    "ReasoningBlock",
    "RegistryFrozen",
    "Spend",
    "Stream",
    "StreamError",
    "StreamEvent",
    "StreamMeta",
    "StreamRejected",
    "ToolCall",
    "UpstreamError",
    "UpstreamTimeout",
    "Usage",
    "accumulate",
    "create_app",
    "load_config",
    "map_stream",
    "register",
]


if TYPE_CHECKING:  # (typed as it is for the checker; loaded only when asked for)
    from .server.app import create_app


def __getattr__(name: str) -> object:
    # The server (aiohttp.web) loads only when asked for.
    if name == "create_app":
        from .server.app import create_app

        return create_app
    raise AttributeError(f"module 'nexus' has no attribute {name!r}")

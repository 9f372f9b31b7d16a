"""Typed app state (``web.AppKey``), in its own module so routes can import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from ..cache.hub import StreamHub
from ..config import Config
from ..encoders.registry import EncoderRegistry
from ..engine import Engine
from ..tokens import StreamTokens
from ..watchdog import Watchdog

if TYPE_CHECKING:
    from .routes.realtime import RealtimeConnection
    from .streaming import StreamPump

__all__ = ["CONFIG", "ENGINE", "HUB", "REGISTRY", "RUNTIME", "TOKENS", "Runtime"]


@dataclass
class Runtime:
    """Mutable per-app state: streams and sockets in flight, and whether we are stopping."""

    active: set[StreamPump] = field(default_factory=set)
    sockets: set[RealtimeConnection] = field(default_factory=set)
    watchdog: Watchdog = field(default_factory=Watchdog)
    """The timers of every streaming response (heartbeats, write stalls)."""
    shutting_down: bool = False


CONFIG = web.AppKey("config", Config)
ENGINE = web.AppKey("engine", Engine)
HUB = web.AppKey("hub", StreamHub)
REGISTRY = web.AppKey("registry", EncoderRegistry)
RUNTIME = web.AppKey("runtime", Runtime)
TOKENS = web.AppKey("tokens", StreamTokens)
"""Makes and checks the read tokens of background streams (``?token=``)."""

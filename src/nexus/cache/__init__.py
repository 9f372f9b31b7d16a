"""Stream resources beyond one connection: logs, resume, record-and-replay, stores.

:class:`StreamHub` opens and finds streams; :class:`StreamRun` is one stream's
producer and log; :mod:`.cursor` renders a log from any resume point; the
stores (:class:`MemoryStore`, :class:`~nexus.cache.redis.RedisStore`) keep
what outlives a process.
"""

from .hub import Opened, StreamHub, cache_key
from .memory import MemoryStore
from .run import StreamRun
from .store import Recording, Store, StreamInfo

__all__ = [
    "MemoryStore",
    "Opened",
    "Recording",
    "Store",
    "StreamHub",
    "StreamInfo",
    "StreamRun",
    "cache_key",
]

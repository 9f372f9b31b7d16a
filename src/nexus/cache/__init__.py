"""Stream resources beyond one connection: runs and their logs, resume, joins,
record-and-replay, admission, stores.

:class:`StreamHub` opens and finds streams; :class:`StreamRun` is one stream's
producer and log; the stores (:class:`MemoryStore`,
:class:`~nexus.cache.redis.RedisStore`) keep what outlives a process.
"""

from .hub import Opened, StreamHub
from .memory import MemoryStore
from .recording import cache_key
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

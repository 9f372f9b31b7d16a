"""Where stream logs and recordings live: the :class:`Store` interface and :class:`StreamInfo`.

A stream runs in one process (its :class:`~nexus.cache.run.StreamRun`); the store is
what outlives it and what other processes see: logs (a *shared* store mirrors a live
one as it grows, so another replica can follow it; every store keeps a finished one for
``resume_ttl_s``), leases (a replica following another's live stream keeps it from being
cancelled as detached), prepaid reads (the first read of a stream after its background
request's ``202``), recordings (whole streams that ended well, by canonical request) and
in-flight claims (identical concurrent requests join one upstream call).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import orjson

from ..events import StreamEvent
from ..types import StreamMeta

__all__ = [
    "MIRROR_INTERVAL_S",
    "OWNER_TTL_S",
    "Recording",
    "Status",
    "Store",
    "StreamInfo",
    "Write",
]

OWNER_TTL_S = 10.0
"""A replica that has not renewed its keep-alive for this long is presumed dead, and so are
its live streams."""

Status = Literal["in_progress", "completed", "failed", "cancelled"]


_META_FIELDS = frozenset(f.name for f in fields(StreamMeta))
_CHARGED_HERE = (
    "failed_attempts",
    "prompt_audio_estimate",
    "prompt_estimate",
    "upstream_accepted",
    "upstream_prompt",
)
_STORED_META = tuple(
    name for name in sorted(_META_FIELDS) if name not in _CHARGED_HERE and name != "joined"
)
"""What a shared store keeps of a meta: not what only the replica that runs the stream
charges or accounts by (replicas from before those fields refuse them), nor what one
listener's copy says of it (``joined``)."""


@dataclass(slots=True)
class StreamInfo:
    """A stream resource: its identity and what its GET needs."""

    meta: StreamMeta
    format: str
    """The media type of the endpoint that made it: ``GET /v1/streams/{id}``'s default."""
    owner: str | None = None
    status: Status = "in_progress"
    created_at: float = field(default_factory=time.time)
    resumable: bool = False
    """It outlives its clients for ``[streams] detach_timeout_s`` (``background``, or
    asked for); otherwise the last client to leave cancels it at once."""
    named: bool = False
    """This process gave its id out (a 202, a response's headers): someone may resume it.
    Not stored; read by :func:`~nexus.cache.readers.forget_unseen`."""

    @property
    def id(self) -> str:
        return self.meta.id

    def to_json(self) -> bytes:
        """What a shared store keeps of it (read back with :meth:`from_json`)."""
        meta = self.meta
        return orjson.dumps(
            {
                "meta": {name: getattr(meta, name) for name in _STORED_META},
                "format": self.format,
                "owner": self.owner,
                "status": self.status,
                "created_at": self.created_at,
                "resumable": self.resumable,
            }
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamInfo:
        """Read back a stored info. A field of the meta this version does not know (written
        by a newer replica, mid rolling upgrade) is left out rather than failing the read."""
        meta = data["meta"]
        if not _META_FIELDS.issuperset(meta):
            meta = {name: value for name, value in meta.items() if name in _META_FIELDS}
        return cls(
            meta=StreamMeta(**meta),
            format=data["format"],
            owner=data.get("owner"),
            status=data["status"],
            created_at=data["created_at"],
            resumable=data.get("resumable", False),
        )


@dataclass(slots=True)
class Write:
    """One step of a live log's mirror into a shared store (:meth:`Store.mirror`)."""

    info: StreamInfo
    events: Sequence[StreamEvent]
    """The log's entries from ``start`` on (with ``end``, through its terminal)."""
    start: int
    """Entries the store has already: 0 writes the log from its start."""
    begin: bool = False
    """Begin the stream first (it was not, or the store lost it)."""
    end: bool = False
    """The stream finished (``info`` says how): kept for the TTL, no longer live."""


@dataclass(slots=True)
class Recording:
    """A stream that ended well: its events (no terminal) and each one's offset in seconds."""

    events: list[StreamEvent]
    offsets: list[float]
    provider: str = ""
    upstream_model: str = ""


MIRROR_INTERVAL_S = 0.01
"""How often, by default, a shared store's mirror writes (also how late a reader on another
replica may be): ``[store] mirror_interval_ms``."""


class Store(ABC):
    """Keeps stream logs, leases, prepaid reads, recordings and in-flight claims. See the
    module docstring."""

    shared: ClassVar[bool] = False
    """Whether other processes see this store (live logs are then mirrored into it)."""
    mirror_interval_s: float = MIRROR_INTERVAL_S
    """A shared store's live logs are mirrored into it at most this often
    (:mod:`nexus.cache.keeper`): longer, more tokens per write, fewer writes."""

    def __init__(self) -> None:
        self.on_error: list[Callable[[str, str], None]] = []
        """Called with the operation's name (``begin``, ``read``...) and the cause
        (``busy``: no connection free in time; ``unreachable``: Redis failed or did not
        answer) each time one fails: the ``nexus_store_errors_total`` metric."""
        self.on_evict: list[Callable[[str, int], None]] = []
        """Called with why (``key_limit``: a key past ``[store] max_bytes_per_key``;
        ``store_full``: past ``max_bytes``) and how many entries went before their TTL:
        the ``nexus_store_evictions_total`` metric."""
        self.live_entries: Callable[[str], int | None] = lambda stream_id: None
        """Set by the hub: how many entries the log of a stream running in this process
        has (None: none runs here). A shared store tells it to replicas that ask
        (:meth:`reached`)."""
        self.on_lost: Callable[[], None] = lambda: None
        """Set by the hub: called when a shared store finds it may have lost what it held
        (restarted, or unreachable past its keep-alive): the live streams' keys are checked
        at once (:meth:`keep_alive`), not at the next periodic renewal."""

    def _evicted(self, reason: str, count: int) -> None:
        if count:
            for tell in self.on_evict:
                tell(reason, count)

    async def start(self) -> None:
        """Connect, and start the store's own tasks; called when the app starts."""

    async def close(self) -> None:
        """Release connections and stop the store's tasks; called when the app stops."""

    # Logs.
    async def begin(self, info: StreamInfo, ttl_s: float) -> None:
        """A live stream starts (shared stores only)."""

    async def mirror(self, writes: Sequence[Write], ttl_s: float) -> list[bool]:
        """Shared stores: ``writes``, together (one round trip). Per write, False when
        ``start`` > 0 and the log is gone from the store: nothing of it was written (the
        caller writes it again from 0). ``ttl_s``: what :meth:`begin` and :meth:`end` take."""
        return [True] * len(writes)

    @abstractmethod
    async def end(
        self,
        info: StreamInfo,
        events: Sequence[StreamEvent],
        start: int,
        ttl_s: float,
        size: int | None = None,
    ) -> None:
        """The stream finished; ``events`` is its whole log, ``events[start:]`` not yet
        appended. It stays readable for ``ttl_s``. ``size``: the sum of
        :func:`~nexus.cache.codec.event_size` over ``events``, if the caller counted it."""

    @abstractmethod
    async def info(self, stream_id: str) -> StreamInfo | None:
        """The stream's info, or None when unknown or expired."""

    @abstractmethod
    def read(self, stream_id: str, start: int = 0) -> AsyncIterator[list[StreamEvent]]:
        """The log from entry ``start`` on, in batches, live until the terminal entry.
        Raises :class:`~nexus.errors.StreamNotFound` if the log is unknown or expired
        (also when it expires while being followed)."""

    async def keep_alive(self, stream_ids: Iterable[str]) -> list[str]:
        """These streams still run: renew their live logs' TTLs (shared stores). Returns
        those the store has lost meanwhile (a restart without persistence): their
        keeper begins them again, or other replicas could not find them until they end."""
        return []

    async def alive(self, stream_id: str) -> bool:
        """Whether the replica running a live ``stream_id`` is still alive."""
        return True

    def forget(self, stream_id: str) -> None:
        """Drop what this process keeps of a live stream whose end will not be written
        (given up while the store was down)."""

    async def reached(self, stream_id: str, entries: int) -> bool:
        """Whether ``stream_id``, live and run by another process, has logged ``entries``
        entries there: its copy here may trail what that process already sent. True
        too when no live process runs it (a read of it tells what became of it); a store
        that is not shared has nothing running elsewhere. Raises
        :class:`~nexus.errors.StoreUnavailable` when it cannot tell."""
        return True

    # Leases.
    async def lease(self, stream_id: str, ttl_s: float) -> None:
        """A client here follows ``stream_id`` (owned elsewhere) for the next ``ttl_s``."""

    async def unlease(self, stream_id: str, hold_s: float, resumable_hold_s: float) -> None:
        """A client here stopped following ``stream_id``: the lease now lapses ``hold_s``
        from now (``resumable_hold_s`` once the stream was made resumable elsewhere,
        :meth:`make_resumable`), however long it had left. Others still following renew it
        sooner than that."""

    async def leased(self, stream_id: str) -> bool:
        """Whether a client elsewhere follows ``stream_id``."""
        return False

    async def held(self, stream_id: str, resumable: bool) -> tuple[float, bool]:
        """Asked by the owner of ``stream_id`` once its last client here left: the seconds
        until the leases of clients elsewhere lapse (0: none left), and whether a resumable
        request elsewhere joined it (it is resumable from now on). When nothing holds it
        (no lease, and ``resumable`` or not made resumable), it is marked as ending, in the
        same step: :meth:`make_resumable` refuses it from then on."""
        return 0.0, False

    async def make_resumable(self, stream_id: str, ttl_s: float, hold_s: float) -> bool:
        """A resumable request here joined ``stream_id``, which runs elsewhere: make it
        resumable (its owner learns it from :meth:`held`, :meth:`info` says it for
        ``ttl_s``) and hold it ``hold_s`` as a client that left just now. False when its
        owner already decided to end it for want of clients: it must not be joined."""
        return False

    async def hold_for_join(self, stream_id: str, hold_s: float) -> bool:
        """A plain request here joined ``stream_id``, which runs elsewhere: held as by a
        reader for ``hold_s`` from now, in the one step that checks its owner has not
        decided to end it for want of clients (False: it must not be joined)."""
        return True

    async def leased_among(self, stream_ids: Sequence[str]) -> set[str]:
        """Those of ``stream_ids`` a client elsewhere follows: one question for all of
        them, so that a caller with a deadline (shutdown) waits for one round trip."""
        return {stream_id for stream_id in stream_ids if await self.leased(stream_id)}

    # Prepaid reads.
    @abstractmethod
    async def prepay_read(self, stream_id: str, key: str, ttl_s: float) -> None:
        """A background request of the API key named ``key`` was answered ``202`` for
        ``stream_id``: its rate token pays for one read of it by that key within ``ttl_s``
        (:func:`~nexus.server.routes.stream_access.prepay_first_read`)."""

    @abstractmethod
    async def take_prepaid_read(self, stream_id: str, key: str) -> bool:
        """Whether a read of ``stream_id`` by ``key`` was paid for (:meth:`prepay_read`,
        within its TTL), taking it in the same step: of concurrent callers, one gets True."""

    # Recordings.
    @abstractmethod
    async def get_recording(self, key: str) -> Recording | None: ...

    @abstractmethod
    async def put_recording(
        self, key: str, recording: Recording, ttl_s: float, owner: str | None = None
    ) -> None:
        """Keep ``recording`` under ``key`` for ``ttl_s``; ``owner``: the key whose stream
        it was (a store may bound what each owner keeps)."""

    # In-flight claims.
    @abstractmethod
    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        """Claim ``key`` for ``stream_id``; the id of the stream that holds it already, if any."""

    @abstractmethod
    async def release(self, key: str, stream_id: str) -> None:
        """Drop the claim on ``key`` if ``stream_id`` holds it."""

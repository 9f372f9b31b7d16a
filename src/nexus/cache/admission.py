"""Admission: the streams running in this process, whose they are, the places they hold.

A request is admitted (:meth:`Admission.admit`) before it opens anything: a place
among ``[limits] max_concurrent_streams`` in this process, and its key's place
(:meth:`~nexus.cache.limits.KeyLimits.admit`: rate, streams, budget). A request
being opened counts as running, so that requests arriving together cannot all pass
a limit only some of them fit in; counted, not scanned (the check is O(1)). A run
started in the block takes the key's :class:`~nexus.cache.limits.Slot` with it
(:meth:`Admission.started`), else the block releases it when it ends. A run stops
counting as it ends, before its end is in its log (:meth:`Admission.ending`), and its
slot leaves a shared count in the same step: a client that saw one request end and
sends the next must find the first running neither here nor elsewhere. Its log may be
kept later (a store that is down is retried for seconds); once it is
(:meth:`Admission.ended`), the slot is released here too, and a run whose end skipped
the first step stops counting then.
"""

from __future__ import annotations

import contextvars
from collections import Counter

from ..auth import ApiKey
from ..errors import TooManyStreams
from .limits import KeyLimits, LocalLimits, Slot

__all__ = ["Admission", "Admitted"]

_ADMITTED: contextvars.ContextVar[Slot | None] = contextvars.ContextVar(
    "nexus_admitted", default=None
)
"""The slot :meth:`Admission.admit` took for the block it runs: the run started in
that block (the same task) takes it over."""


class Admission:
    """Counts of the streams running here, per owner (API key name), and their slots."""

    def __init__(self) -> None:
        self.live = 0
        self._owned: Counter[str] = Counter()  # live runs per owner
        self._opening = 0  # admitted requests with no live run (yet, or at all)
        self._opening_owned: Counter[str] = Counter()
        self._slots: dict[str, Slot] = {}  # run id -> the key's slot it holds
        self._counted: dict[str, str | None] = {}  # run id -> its owner, until it ends
        self.limits: KeyLimits = LocalLimits(0.0, None, self.running)
        """Per-key rates, streams and budgets (the app sets the configured ones)."""

    def running(self, owner: str | None = None) -> int:
        """Streams running here, or ``owner``'s: those live and the requests admitted
        without a live run (being opened, or answered without one)."""
        if owner is None:
            return self.live + self._opening
        return self._owned[owner] + self._opening_owned[owner]

    def admit(
        self, key: ApiKey | None, limit: int, *, rate_taken: bool = False, hold: float = 0.0
    ) -> Admitted:
        """Admit a request for the block (``async with``; see the module docstring);
        ``rate_taken``: its key's rate token was taken already; ``hold``: its worst case
        (USD), held against a budget (:mod:`nexus.cache.limits`).

        Raises :class:`TooManyStreams` past ``limit`` streams in this process, and
        what :meth:`KeyLimits.admit` raises.
        """
        return Admitted(self, key, limit, rate_taken, hold)

    def started(self, run_id: str, owner: str | None) -> None:
        """A run started: it counts, and holds the slot admitted for this task."""
        self.live += 1
        self._counted[run_id] = owner
        slot = _ADMITTED.get()
        if slot is not None and not slot.taken and slot.key == owner:
            slot.taken = True  # the run holds it now, until ended()
            self._slots[run_id] = slot
        if owner is not None:
            self._owned[owner] += 1

    def slot_of(self, run_id: str) -> Slot | None:
        """The key's slot the run ``run_id`` holds, if any."""
        return self._slots.get(run_id)

    async def ending(self, run_id: str) -> None:
        """A run :meth:`started` is ending (its end hooks ran): it no longer counts, and
        its key's slot goes from a shared count now, before its end is published (see the
        module docstring)."""
        self._uncount(run_id)
        slot = self._slots.get(run_id)
        if slot is not None:
            await self.limits.end(slot)

    def ended(self, run_id: str) -> None:
        """A run :meth:`started` ended, its log kept (called once)."""
        self._uncount(run_id)
        slot = self._slots.pop(run_id, None)
        if slot is not None:
            self.limits.release(slot)

    def _uncount(self, run_id: str) -> None:
        """The run no longer counts among the streams running here (once)."""
        if run_id in self._counted:
            owner = self._counted.pop(run_id)
            self.live -= 1
            if owner is not None:
                _discount(self._owned, owner)


class Admitted:
    """The block of :meth:`Admission.admit`: an object with ``__aenter__`` and
    ``__aexit__``, not a generator's context manager (a generator, its wrapper and two
    more steps a request)."""

    __slots__ = ("_admission", "_hold", "_key", "_limit", "_rate", "_slot", "_token")

    def __init__(
        self, admission: Admission, key: ApiKey | None, limit: int, rate_taken: bool, hold: float
    ) -> None:
        self._admission = admission
        self._key = key
        self._limit = limit
        self._rate = not rate_taken
        self._hold = hold
        self._slot: Slot | None = None
        self._token: contextvars.Token[Slot | None] | None = None

    async def __aenter__(self) -> None:
        admission, key, limit = self._admission, self._key, self._limit
        if admission.running() >= limit:
            raise TooManyStreams(
                f"The gateway is at its limit of {limit} concurrent streams "
                "([limits] max_concurrent_streams); retry shortly.",
                headers={"Retry-After": "1"},
            )
        admission._opening += 1
        if key is not None:
            try:
                self._slot = await admission.limits.admit(
                    key, stream=True, rate=self._rate, hold=self._hold
                )
            except BaseException:
                admission._opening -= 1
                raise
            admission._opening_owned[key.name] += 1
        self._token = _ADMITTED.set(self._slot)

    async def __aexit__(self, *exc_info: object) -> None:
        admission, key, slot = self._admission, self._key, self._slot
        try:
            if self._token is not None:
                _ADMITTED.reset(self._token)
            if key is not None:
                _discount(admission._opening_owned, key.name)
            if slot is not None and not slot.taken:
                admission.limits.release(slot)
        finally:
            admission._opening -= 1


def _discount(counts: Counter[str], owner: str) -> None:
    """One less for ``owner``; none left, no entry (the counter holds active keys only)."""
    counts[owner] -= 1
    if counts[owner] <= 0:
        del counts[owner]

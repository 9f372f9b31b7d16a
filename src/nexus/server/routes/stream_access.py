"""Who may use an existing stream: :func:`find_stream`, for the stream routes and a POST
that resumes one.

With keys configured, a stream is found only for the key that made it, or (on a GET) for
its read token (:mod:`nexus.tokens`); another key's stream is the same 404, after the same
lookup, as one that does not exist. Every lookup takes a token of a key's rate (but the
one read a ``202`` paid for, below): the caller's, or for a read token the key it was
issued to (with ``[cache] share_across_keys`` a background request that joined another
key's stream gets one: its reads are its own key's, never charged to the owner it could
otherwise lock out). A cancel that finds the caller's own stream takes none (a key past its
rate must still be able to stop what spends its budget); one that finds nothing of the
caller's takes one after its lookup, so that ids that are not the caller's cannot be probed
at the store unmetered.

A reader (a GET, a resume) also takes a place among its key's readers
(:mod:`.key_readers`) before its lookup: the caller's, or the read token's key (for a
token that names none, the stream owner's, once the lookup has named it).

One user action, one rate token: a browser reads a background request's stream with an
``EventSource``, a second request milliseconds after the ``202``, which a key at one
request per second could never make. So the token the background request took also pays
for the first read of its stream by its key (with its read token or the key itself) within
:data:`FIRST_READ_WINDOW_S` of the ``202`` (:func:`prepay_first_read`); every other read
takes one as above. The store keeps that prepaid read and takes it atomically
(:meth:`~nexus.cache.store.Store.take_prepaid_read`): one per ``202``, on any replica, even
for concurrent reads. Only its rate token is prepaid: its reader place is taken as always.
"""

from __future__ import annotations

import hmac
import time
from contextlib import ExitStack, suppress
from typing import Any

from aiohttp import web

from ...auth import ApiKey, Unauthorized
from ...cache.store import StreamInfo
from ...errors import StoreUnavailable, StreamNotFound
from ...types import stream_id_of
from .. import state
from ..access import KEYS, exchange
from ..key_admission import admit, authenticate
from .key_readers import key_reader

__all__ = [
    "FIRST_READ_WINDOW_S",
    "describe",
    "find_stream",
    "prepay_first_read",
    "stream_not_found",
]

FIRST_READ_WINDOW_S = 30.0
"""How long after a background request's ``202`` the first read of its stream is paid for
by that request's rate token: ample for a client that reads at once (a page opening its
``EventSource``), short enough that the read is that action's, not a later one's."""


async def find_stream(
    request: web.Request,
    stream_id: str,
    *,
    read_token: bool = False,
    rated: bool = True,
    reading: ExitStack | None = None,
) -> StreamInfo:
    """The stream ``stream_id``, if the caller may use it (see the module docstring).

    With ``read_token`` (a GET), a ``?token=`` query parameter authorises the request
    instead of a key. A key's request takes a token of its rate first, unless not
    ``rated`` (a cancel: then only a 404 takes one, after its lookup); a token's takes
    one of the rate of the key it names (of its stream owner's, once the stream is found,
    for a token that names none), but for the read its background request's ``202`` paid
    for (:func:`prepay_first_read`). With ``reading``, the request is a reader: its place
    among its key's readers is entered on that stack (the caller holds it while it writes
    the stream). Raises
    :class:`~nexus.auth.Unauthorized` (401 ``invalid_api_key``), 429 ``rate_limited``,
    429 ``too_many_readers`` and :func:`stream_not_found` (404, also for another key's
    stream).
    """
    app = request.app
    stream_id = stream_id_of(stream_id)  # a background response's resp_ id names it too
    owner, reader = _reader(request, stream_id, read_token)
    hub = app[state.HUB]
    if reader is not None and reading is not None:
        reading.enter_context(await key_reader(request, reader))  # before any lookup
    if reader is not None and rated:
        await _charge_read(request, exchange(request).key, stream_id, reading is not None)
    info = await hub.info(stream_id)
    if info is not None and reader is None and app[KEYS].enabled:
        # A read token that names no key reads as its stream owner: a place among that
        # key's readers and a token of its rate (a token leaked in a URL would otherwise
        # re-render the log unmetered).
        if reading is not None:
            reading.enter_context(await key_reader(request, info.owner))
        await _charge_read(request, app[KEYS].named(info.owner), stream_id, reading is not None)
    if info is not None and owner is not None and not _same_owner(info.owner, owner):
        if hub.store.shared and hub.local(stream_id) is not None:
            # Found here without the store's round trip that a missing id costs: take
            # it too, so that the time does not tell another key a live stream's id.
            await hub.store.info(stream_id)
        info = None
    if info is None:
        if owner is not None and not rated:  # a probe of ids not the key's is metered
            await admit(request, exchange(request).key, None)
        raise stream_not_found(stream_id)
    return info


async def prepay_first_read(request: web.Request, stream_id: str, key: ApiKey | None) -> None:
    """Called before a background request's ``202`` is sent: the rate token it took pays
    for the first read of ``stream_id`` by ``key`` (see the module docstring). Without a
    key or a rate there is nothing to pay; a store that fails leaves that read to pay."""
    if key is None or not request.app[state.CONFIG].limits.requests_per_second_per_key:
        return
    with suppress(StoreUnavailable):  # (counted by the store) that read pays its token
        await request.app[state.HUB].store.prepay_read(stream_id, key.name, FIRST_READ_WINDOW_S)


async def _charge_read(
    request: web.Request, key: ApiKey | None, stream_id: str, reading: bool
) -> None:
    """A token of ``key``'s rate for a lookup of ``stream_id``; none for the read a ``202``
    paid for (:func:`prepay_first_read`), taken here. Raises 429 ``rate_limited``."""
    if key is None:
        return
    if reading and request.app[state.CONFIG].limits.requests_per_second_per_key:
        try:
            if await request.app[state.HUB].store.take_prepaid_read(stream_id, key.name):
                return
        except StoreUnavailable:
            pass  # (counted by the store) the read pays its own way
    await admit(request, key, None)


def describe(info: StreamInfo, read_token: str | None = None) -> dict[str, Any]:
    """The JSON a background request answers with (and a DELETE, without a token).

    With ``read_token`` (see :mod:`nexus.tokens`) it is included, and ``url`` carries
    it as ``?token=``: a URL a browser's ``EventSource`` can read without headers.
    """
    body: dict[str, Any] = {
        "id": info.id,
        "url": f"/v1/streams/{info.id}",
        "status": info.status,
        "resumable": info.resumable,
    }
    if read_token is not None:
        body["url"] += f"?token={read_token}"
        body["read_token"] = read_token
    return body


def stream_not_found(stream_id: str) -> StreamNotFound:
    """The one answer for a stream that is not there, or not the caller's."""
    return StreamNotFound(
        f"No stream {stream_id!r}: unknown, or expired (finished streams are kept for "
        "[streams] resume_ttl_s).",
        param="id",
    )


def _reader(
    request: web.Request, stream_id: str, read_token: bool
) -> tuple[str | None, str | None]:
    """Whose streams the caller may use (a key's name; None for any: no keys, or a valid
    read token for this stream), and which key its reading is charged to (the caller's, a
    token's; None: no keys, or a token that names no key). Raises :class:`Unauthorized`."""
    app = request.app
    keys = app[KEYS]
    if not keys.enabled:
        return None, None
    if read_token:
        token = request.query.get("token")
        if token is not None:
            grant = app[state.TOKENS].check(token, stream_id, time.time())
            holder = None if grant is None or grant.key is None else keys.named(grant.key)
            if grant is None or (grant.key is not None and holder is None):
                raise Unauthorized(
                    "Invalid read token: malformed, expired, not this stream's, or of a key "
                    "no longer configured.",
                    headers={"WWW-Authenticate": 'Bearer realm="nexus"'},
                )
            exchange(request).key = holder  # the access line's key: who reads
            return None, None if holder is None else holder.name
    key = authenticate(request)
    if key is None:  # not with keys configured; never read as "any stream"
        raise Unauthorized("Missing API key.", headers={"WWW-Authenticate": 'Bearer realm="nexus"'})
    return key.name, key.name


def _same_owner(owner: str | None, name: str) -> bool:
    return owner is not None and hmac.compare_digest(owner.encode(), name.encode())

"""What every HTTP upstream shares: a pool of connections (:mod:`.connections`), the
request's head and headers, and one :class:`~.exchange.UpstreamExchange` per request (the
body fed to the provider's decoder as it arrives, timeouts, failures). Connection errors
and upstream statuses become the most specific :mod:`nexus.errors` class once
(:func:`~.connections.map_upstream_errors`, :func:`~nexus.protocol.upstream.status_error`):
raised before the first event, an error may send the engine to the next target; after, an
error event. Bodies are asked for and read as sent (``Accept-Encoding: identity``): a
compressed one (a bomb waiting: 300 MB of comments in 306 KB of gzip held the loop for
every tenant) is a protocol error. A stream holds its pooled connection
(``max_connections``) for its whole length; a request's wait for one goes to the
provider's ``on_pool_wait`` callbacks (a histogram) and to the call's
:data:`~.connections.POOL_WAITS` (``pool_wait_ms``). Keys go out in headers only, never in
logs, errors or ``repr``.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from .. import __version__
from ..config import HTTPProviderConfig
from ..errors import (
    UpstreamError,
)
from ..protocol.upstream import (
    UpstreamDecoder,
    keep_secret,
)
from ..request import ChatRequest
from ..stream import Batches
from ..telemetry import upstream_headers
from ..watchdog import Watchdog
from .base import Provider
from .connections import (
    ConnectionPool,
    HeaderRefused,
    map_upstream_errors,
    request_target,
    trusting,
)
from .exchange import UpstreamExchange

__all__ = ["HTTPProvider", "map_upstream_errors"]

log = logging.getLogger("nexus.providers")

USER_AGENT = f"nexus/{__version__}"
"""Sent upstream on every request: a provider's logs tell which gateway release sent what."""


class HTTPProvider(Provider):
    """A provider streaming from an HTTP endpoint: a subclass gives ``path``, ``headers()``
    and, in :meth:`upstream`, the body and the stream's decoder."""

    path: ClassVar[str]

    def __init__(self, name: str, config: HTTPProviderConfig, api_key: str | None = None) -> None:
        super().__init__(name, models=config.models)
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        self._api_key = api_key
        keep_secret(api_key)  # never quoted back from an upstream's error text
        self._tls = None if config.ca_file is None else trusting(config.ca_file)
        self._pool: ConnectionPool | None = None
        self._target = request_target(self.base_url, self.path)  # the request line's
        ConnectionPool.check_headers(self.headers())  # a key that cannot be sent stops here
        self._watchdog = Watchdog()  # the read timeouts of every response
        self.on_pool_wait: list[Callable[[float], None]] = []  # each request's pool wait (s)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.base_url}>"

    async def start(self) -> None:
        config = self.config
        self._pool = ConnectionPool(
            self.base_url, config.max_connections, config.connect_timeout_s, self._tls
        )

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        await self._watchdog.stop()

    def headers(self) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",  # see the module docstring
            "User-Agent": USER_AGENT,
        }

    @abstractmethod
    def upstream(self, request: ChatRequest, model: str) -> tuple[dict[str, Any], UpstreamDecoder]:
        """The upstream request's body for ``request``, and a decoder for its stream."""

    def batches(self, request: ChatRequest, model: str) -> Batches:
        """One list of events per upstream read, until the decoder's end; a body that
        ends before it is :class:`~nexus.errors.UpstreamDisconnected`, never a success."""
        return UpstreamExchange(self, request, model)

    def request_headers(self, request: ChatRequest) -> dict[str, str] | None:
        return None  # headers of the request's own, beside headers()

    def request_head(
        self, pool: ConnectionPool, length: int, extra: dict[str, str] | None = None
    ) -> bytes:
        """The request's line and headers, for a body of ``length`` bytes."""
        headers = self.headers() if extra is None else self.headers() | extra
        headers = upstream_headers(headers, self.base_url + self.path)
        try:
            return pool.request_head(self._target, headers, length)
        except HeaderRefused as exc:
            raise UpstreamError(f"provider {self.name!r}: {exc}", retryable=False) from None

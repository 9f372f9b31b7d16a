"""The web console: ``GET /`` is ``web/index.html``; ``/web/<file>`` the rest of ``web/``.

Plain files, no build step. An installed wheel carries them as ``nexus/web``;
a source checkout serves the repository's ``web/``.

They are read once, when the routes are added, and answered from memory like any
other response: not with ``sendfile``, whose writes (with asyncio's own loop) go
past the connection's ``pause_writing``, so that a client that asks for them and
reads nothing would not be seen stalling (:mod:`nexus.server.connection`).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

__all__ = ["WEB_DIR", "add_routes"]


def _find() -> Path | None:
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "web", here.parents[4] / "web"):
        if (candidate / "index.html").is_file():
            return candidate
    return None


WEB_DIR = _find()

_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
        "media-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
        "frame-ancestors 'none'"  # it holds a key: no other page may frame it (clickjacking)
    ),
    "X-Frame-Options": "DENY",  # the same, for browsers without CSP level 2
}


_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def add_routes(app: web.Application) -> None:
    """Serve the console if its files are here (a stripped install may leave them out)."""
    if WEB_DIR is None:
        return
    files = {
        path.name: (path.read_bytes(), _TYPES[path.suffix])
        for path in WEB_DIR.iterdir()
        if path.is_file() and path.suffix in _TYPES
    }

    def answer(name: str) -> web.Response:
        body, content_type = files[name]
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=_HEADERS)

    async def index(request: web.Request) -> web.StreamResponse:
        return answer("index.html")

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in files:
            raise web.HTTPNotFound()
        return answer(name)

    app.router.add_get("/", index)
    app.router.add_get("/web/{name}", asset)

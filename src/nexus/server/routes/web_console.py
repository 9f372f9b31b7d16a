"""The web console: ``GET /`` is ``web/index.html``; ``/web/<file>`` the rest of ``web/``.

Plain files, no build step. An installed wheel carries them as ``nexus/web``;
a source checkout serves the repository's ``web/``.
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
        "media-src 'self' data: blob:; style-src 'self'; script-src 'self'"
    ),
}


async def index(request: web.Request) -> web.StreamResponse:
    assert WEB_DIR is not None
    return web.FileResponse(WEB_DIR / "index.html", headers=_HEADERS)


def add_routes(app: web.Application) -> None:
    """Serve the console if its files are here (a stripped install may leave them out)."""
    if WEB_DIR is None:
        return
    app.router.add_get("/", index)
    app.router.add_static("/web/", WEB_DIR, follow_symlinks=False, show_index=False)

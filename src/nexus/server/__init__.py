"""The inbound I/O edge: the only package that imports ``aiohttp.web``."""

from .app import create_app

__all__ = ["create_app"]

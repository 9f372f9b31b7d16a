"""How many pages a PDF has, from its bytes, within a bound of work. Sans-I/O.

A provider bills a PDF by its pages (Anthropic: its text, and an image of each page), not by
its bytes: a PDF that repeats one compressed content stream on each of 40 pages is 7 KB and
about 100,000 tokens. A budget must hold it at that (:mod:`nexus.estimates`). The page
objects (``/Type /Page``) and the page tree's ``/Count`` are read where they are plain, and
in compressed object streams (PDF 1.5 and later) inflated up to :data:`MAX_INFLATED` bytes
in all; a PDF that tells neither is None, for the caller to assume the worst.
"""

from __future__ import annotations

import re
import zlib

__all__ = ["MAX_INFLATED", "MAX_PAGES", "pdf_pages"]

MAX_INFLATED = 64 * 1024 * 1024
"""The most object-stream bytes inflated for one PDF (a bomb inflates no further)."""
MAX_PAGES = 1000
"""Past any provider's limit per request (Anthropic's: 100): a count larger is this."""

_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")
_COUNT = re.compile(rb"/Count\s+(\d{1,9})")
_OBJECT_STREAM = re.compile(rb"/Type\s*/ObjStm")
_STREAM = re.compile(rb"stream\r?\n")


def pdf_pages(data: bytes) -> int | None:
    """The pages of the PDF ``data`` (at most :data:`MAX_PAGES`), or None if it says not."""
    pages, counts = _found(data)
    if not pages and not counts:
        budget = MAX_INFLATED
        for marker in _OBJECT_STREAM.finditer(data):
            start = _STREAM.search(data, marker.end())
            end = -1 if start is None else data.find(b"endstream", start.end())
            if start is None or end < 0:
                break
            try:
                inflated = zlib.decompressobj().decompress(data[start.end() : end], budget)
            except zlib.error:
                continue
            found, more = _found(inflated)
            pages, counts = pages + found, counts + more
            budget -= len(inflated)
            if budget <= 0:
                break
    # The page tree's root counts every page (an outline's /Count counts its items: the
    # larger of the two is taken, a hold's error on the safe side).
    pages = max([pages, *counts])
    return min(pages, MAX_PAGES) if pages else None


def _found(data: bytes) -> tuple[int, list[int]]:
    return len(_PAGE.findall(data)), [int(count) for count in _COUNT.findall(data)]

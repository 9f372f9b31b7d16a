"""How many pages a PDF has, from its bytes, within a bound of work. Sans-I/O.

A provider bills a PDF by its pages (Anthropic: its text, and an image of each page), not by
its bytes: a PDF that repeats one compressed content stream on each of 40 pages is 7 KB and
about 100,000 tokens. A budget must hold it at that (:mod:`nexus.estimates`). The page
objects (``/Type /Page``) and the page tree's ``/Count`` are read where they are plain, and
in compressed object streams (PDF 1.5 and later) inflated up to :data:`MAX_INFLATED` bytes
in all, the file read once (a PDF of many stream markers and one end cost the square of its
size); a PDF that tells neither is None, for the caller to assume the worst.
"""

from __future__ import annotations

import re
import zlib

__all__ = ["MAX_INFLATED", "MAX_OBJECT_STREAMS", "MAX_PAGES", "pdf_pages"]

MAX_INFLATED = 64 * 1024 * 1024
"""The most object-stream bytes inflated for one PDF (a bomb inflates no further)."""
MAX_PAGES = 1000
"""Past any provider's limit per request (Anthropic's: 100): a count larger is this."""
MAX_OBJECT_STREAMS = 10_000
"""Object streams read in one PDF at most (each a zlib call)."""

_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")
_COUNT = re.compile(rb"/Count\s+(\d{1,9})")
_OBJECT_STREAM = re.compile(rb"/Type\s*/ObjStm")
_STREAM = re.compile(rb"stream\r?\n")


def pdf_pages(data: bytes) -> int | None:
    """The pages of the PDF ``data`` (at most :data:`MAX_PAGES`), or None if it says not.
    Page objects are counted in the plain bytes and in every object stream (an update may
    write one page plainly and leave the rest packed), each stream once, in one pass."""
    pages, counts = _found(data)
    budget, at = MAX_INFLATED, 0
    for _ in range(MAX_OBJECT_STREAMS):
        marker = _OBJECT_STREAM.search(data, at)
        start = None if marker is None else _STREAM.search(data, marker.end())
        end = -1 if start is None else data.find(b"endstream", start.end())
        if start is None or end < 0 or budget <= 0:
            break
        at = end  # the next stream after this one's end: the file is read once
        try:
            inflated = zlib.decompressobj().decompress(data[start.end() : end], budget)
        except zlib.error:
            budget -= end - start.end()  # (its bytes count against the bound even so)
            continue
        found, more = _found(inflated)
        pages, counts = pages + found, counts + more
        budget -= max(len(inflated), end - start.end())
    # The page tree's root counts every page (an outline's /Count counts its items: the
    # larger of the two is taken, a hold's error on the safe side).
    pages = max([pages, *counts])
    return min(pages, MAX_PAGES) if pages else None


def _found(data: bytes) -> tuple[int, list[int]]:
    return len(_PAGE.findall(data)), [int(count) for count in _COUNT.findall(data)]

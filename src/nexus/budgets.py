"""Budget periods: which window a moment falls in, and when it ends. Sans-I/O.

A key's spend is kept per window: a UTC day (``"2026-11-25"``), a UTC month
(``"2026-11"``) or ``"total"``, which never ends. A window's spend stays in the store
until a day past its end (for ``nexus keys`` and late charges), then expires.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

__all__ = ["PERIODS", "Window", "budget_message", "key_table", "window"]

PERIODS = ("day", "month", "total")

_KEEP_AFTER_END_S = 86_400.0
"""How long a window's spend outlives its end in the store."""


@dataclass(frozen=True, slots=True)
class Window:
    """A budget window: its id (part of the store's key) and its end (epoch seconds)."""

    id: str
    resets_at: float | None

    def ttl_s(self, now: float) -> float | None:
        """How long the store keeps this window's spend from ``now`` (None: for good)."""
        if self.resets_at is None:
            return None
        return max(self.resets_at - now, 0.0) + _KEEP_AFTER_END_S

    def retry_after_s(self, now: float) -> int | None:
        """Whole seconds until the window resets, at least 1 (None: it never does)."""
        if self.resets_at is None:
            return None
        return max(1, math.ceil(self.resets_at - now))

    def resets_iso(self) -> str | None:
        """The reset time as ISO 8601 UTC (``2026-11-26T00:00:00Z``), or None."""
        if self.resets_at is None:
            return None
        moment = dt.datetime.fromtimestamp(self.resets_at, dt.UTC)
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def window(period: str, now: float) -> Window:
    """The window of ``period`` that ``now`` falls in. Raises ``ValueError`` for another."""

    if period == "total":
        return Window("total", None)
    moment = dt.datetime.fromtimestamp(now, dt.UTC)
    if period == "day":
        start = dt.datetime(moment.year, moment.month, moment.day, tzinfo=dt.UTC)
        end = start + dt.timedelta(days=1)
        return Window(start.strftime("%Y-%m-%d"), end.timestamp())
    if period == "month":
        year, month = (
            (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
        )
        end = dt.datetime(year, month, 1, tzinfo=dt.UTC)
        return Window(moment.strftime("%Y-%m"), end.timestamp())
    raise ValueError(f"unknown budget period {period!r} (expected one of {PERIODS})")


def budget_message(name: str, budget: float, period: str, spent: float, win: Window) -> str:
    """What a refused request is told: the budget, the spend, and when it resets."""
    which = {"day": "daily", "month": "monthly", "total": "total"}[period]
    text = f"The API key {name!r} has spent ${spent:.6g} of its {which} budget of ${budget:g}"
    resets = win.resets_iso()
    if resets is None:
        return text + '; it does not reset (budget_period = "total").'
    return text + f"; it resets at {resets}."


def key_table(rows: list[dict[str, str]]) -> str:
    """``nexus keys``'s table: a header and one line per key, columns padded to fit."""
    columns = ("name", "models", "budget_usd", "period", "spent_usd", "resets_at")
    cells = [list(columns), *([row.get(column, "-") for column in columns] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )

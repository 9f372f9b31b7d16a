"""What a stream spent: its tokens and their cost in USD. Sans-I/O.

A stream's price (``[models."<name>"]``, USD per million tokens) is its served target's
(``provider/model``), else its alias's, else none (``cost_usd`` is None). The cost is
computed from the usage the upstream reported, never guessed::

    (prompt - cached) * input + cached * cached_input + completion * output

``completion`` includes reasoning tokens, as OpenAI counts them; tokens written to a
prompt cache are part of ``prompt``. A stream that ended without a final usage reports
what it saw, marked ``estimated``: the last usage's prompt and cached tokens, and as
completion tokens the larger of that usage's and the output events seen (one token
each, as streaming upstreams and the mock deliver them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .events import Delta, Done, Error, Reasoning, StreamEvent, ToolCall, Usage
from .types import StreamMeta

__all__ = [
    "NOTHING",
    "UNKNOWN",
    "Price",
    "PriceTable",
    "Spend",
    "Tally",
    "cost_usd",
    "spend_of",
    "tally",
    "terminal_ok",
]

PER_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class Spend:
    """What one stream spent upstream (``cost_usd`` None: no price applies)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    cost_usd: float | None
    estimated: bool


NOTHING = Spend(0, 0, 0, 0, 0.0, False)
"""The spend of a request that called no upstream (a cache hit)."""

UNKNOWN = Spend(0, 0, 0, 0, None, True)
"""A spend nobody counted."""


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens."""

    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_input_usd_per_mtok: float


class PriceTable:
    """Prices by model name (alias or ``provider/model``)."""

    __slots__ = ("prices",)

    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self.prices: dict[str, Price] = dict(prices or {})

    def __bool__(self) -> bool:
        return bool(self.prices)

    def price(self, served: str, asked: str) -> Price | None:
        """The price for a stream served by ``served`` (``provider/model``) for ``asked``."""
        found = self.prices.get(served)
        return found if found is not None else self.prices.get(asked)

    def spend(self, tallied: Tally, meta: StreamMeta, *, complete: bool) -> Spend:
        """The spend of the stream ``meta`` names (served by ``meta.provider``)."""
        served = f"{meta.provider}/{meta.upstream_model}"
        return spend_of(tallied, self.price(served, meta.model), complete=complete)


def cost_usd(price: Price, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> float:
    """The cost of these tokens at ``price``. Cached tokens beyond the prompt count as
    prompt tokens (an upstream that reports more cached than prompt is not trusted)."""
    cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
    uncached = max(prompt_tokens, 0) - cached
    micro = (
        uncached * price.input_usd_per_mtok
        + cached * price.cached_input_usd_per_mtok
        + max(completion_tokens, 0) * price.output_usd_per_mtok
    )
    return micro / PER_TOKENS


@dataclass(slots=True)
class Tally:
    """What a stream's events say of its spend: its last usage, its output events."""

    usage: Usage | None = None
    produced: int = 0
    """Content, reasoning and tool call deltas seen."""

    def add(self, event: StreamEvent) -> None:
        cls = type(event)
        if cls is Usage:
            self.usage = event  # type: ignore[assignment]
        elif cls is Delta:
            if event.content or event.tool_calls or event.refusal:  # type: ignore[union-attr]
                self.produced += 1
        elif cls is Reasoning or cls is ToolCall:
            self.produced += 1


def tally(events: Sequence[StreamEvent], *, complete: bool) -> Tally:
    """A :class:`Tally` of a finished log (a complete one's final usage, if it has one)."""
    if complete:
        for event in reversed(events):
            if type(event) is Usage:
                return Tally(usage=event)
    result = Tally()
    add = result.add
    for event in events:
        add(event)
    return result


def spend_of(tallied: Tally, price: Price | None, *, complete: bool) -> Spend:
    """The :class:`Spend` of a stream; ``complete``: its last usage is the final count."""

    usage = tallied.usage
    if usage is not None:
        prompt = usage.prompt_tokens
        completion = usage.completion_tokens
        cached = usage.cached_tokens or 0
        reasoning = usage.reasoning_tokens or 0
        estimated = False
        if not complete and tallied.produced > completion:
            completion, estimated = tallied.produced, True
    else:
        prompt = cached = reasoning = 0
        completion = tallied.produced
        estimated = True
    cost = None if price is None else cost_usd(price, prompt, completion, cached)
    return Spend(prompt, completion, cached, reasoning, cost, estimated)


def terminal_ok(event: StreamEvent) -> bool:
    """Whether a stream that ended with ``event`` completed (not failed, not aborted)."""
    if type(event) is Error:
        return False
    return not (type(event) is Done and event.aborted)

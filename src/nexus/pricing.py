"""What a stream spent: its tokens and their cost in USD. Sans-I/O.

A stream's price (``[models."<name>"]``, USD per million tokens) is its served target's
(``provider/model``), else its alias's, else none (``cost_usd`` is None). The cost is
computed from the usage the upstream reported::

    (prompt - cached - written - heard) * input + heard * audio_input
        + cached * cached_input + (written - long) * cache_write + long * cache_write_1h
        + (completion - spoken) * output + spoken * audio_output

``completion`` includes reasoning and audio tokens, as OpenAI counts them; ``spoken`` are
its audio tokens, ``heard`` the prompt's audio tokens that are neither cached nor written
(cached and written tokens cost their own prices, whatever they hold). Without an audio
price audio tokens cost the text price, an underestimate (OpenAI bills them dearer): a key
with a budget is then refused a request for audio (:func:`unpriced`). ``cached`` are
prompt tokens read from a prompt cache, ``written`` those written to one (Anthropic bills
them above the input price: 1.25x for five minutes, 2x for an hour, ``long``), both part of
``prompt``. A stream that ended without a final
usage reports what it saw, marked ``estimated``: the last usage's prompt, cached and
written tokens, and as completion tokens the larger of that usage's and the output
output seen (a token a piece at least, one per 4 bytes of its text: :class:`Tally`; audio
by its duration, as audio tokens). One the upstream answered without
reporting any usage (cut before it: OpenAI reports usage last; or from an upstream that
reports none) is charged :func:`~nexus.estimates.prompt_estimate` as its prompt,
:func:`~nexus.estimates.prompt_audio_estimate` of it as audio (by its duration): without
it, a client could send a long prompt and leave at the first token having spent almost
nothing of its budget.

An attempt that failed after its upstream took the request, before any event, is not the
stream's spend: :class:`FailedAttempts` says what such attempts may have cost, charged to
no budget (the upstream may bill them, or not: the failure is its own).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import astuple, dataclass, replace
from typing import Any

from .estimates import (
    CHARS_PER_TOKEN,
    SPOKEN_BYTES_PER_TOKEN,
    prompt_audio_estimate,
    prompt_estimate,
    spoken_bytes,
)
from .events import MAX_TOKENS, Audio, Delta, Done, Error, Reasoning, StreamEvent, ToolCall, Usage
from .request import AssistantMessage, AudioPart, ChatRequest, FilePart, audio_reference
from .types import StreamMeta

__all__ = [
    "MAX_USD_PER_MTOK",
    "NOTHING",
    "UNKNOWN",
    "FailedAttempts",
    "Price",
    "PriceTable",
    "Spend",
    "Tally",
    "cost_usd",
    "spend_of",
    "tally",
    "terminal_ok",
    "unpriced",
    "worst_cost",
]

PER_TOKENS = 1_000_000
MAX_USD_PER_MTOK = 1_000_000_000.0
"""The dearest price a :class:`Price` takes (millions of times any model's): with counts
at most :data:`~nexus.events.MAX_TOKENS`, every cost is a finite number."""


@dataclass(frozen=True, slots=True)
class FailedAttempts:
    """What a stream's failed attempts may have cost upstream, never charged: attempts
    whose upstream took the request (a 2xx), then failed before any event came
    (:class:`~nexus.types.FailedAttempt`). Each is its prompt (the upstream's count if it
    gave one, else the stream's estimate) at its own target's price; it had streamed
    nothing (the router falls back, or gives up, only before a target's first event).
    ``cost_usd``: the priced attempts' (None: none was priced)."""

    count: int
    prompt_tokens: int
    cost_usd: float | None


@dataclass(frozen=True, slots=True)
class Spend:
    """What one stream spent upstream (``cost_usd`` None: no price applies).
    ``failed_attempts``: what the attempts before, that failed after their upstream took
    the request, may have cost on top; not part of the rest, nor charged."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    cost_usd: float | None
    estimated: bool
    cache_write_tokens: int = 0
    prompt_audio_tokens: int = 0
    completion_audio_tokens: int = 0
    failed_attempts: FailedAttempts | None = None


NOTHING = Spend(0, 0, 0, 0, 0.0, False)
"""The spend of a request that called no upstream (a cache hit)."""

UNKNOWN = Spend(0, 0, 0, 0, None, True)
"""A spend nobody counted."""


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens (``cache_write_usd_per_mtok`` None: the input price;
    ``cache_write_1h_usd_per_mtok`` None: twice it, Anthropic's rate for an hour's writes;
    an audio price None: the text price, and a key with a budget is refused audio that
    way, :func:`unpriced`)."""

    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_input_usd_per_mtok: float
    cache_write_usd_per_mtok: float | None = None
    audio_input_usd_per_mtok: float | None = None
    audio_output_usd_per_mtok: float | None = None
    cache_write_1h_usd_per_mtok: float | None = None

    @property
    def long_write(self) -> float:
        """An hour's cache write (USD per million tokens)."""
        given = self.cache_write_1h_usd_per_mtok
        return 2 * self.input_usd_per_mtok if given is None else given

    def __post_init__(self) -> None:
        for usd in astuple(self):
            if usd is not None and not (0.0 <= usd <= MAX_USD_PER_MTOK):  # NaN fails too
                raise ValueError(f"a price must be from 0 to {MAX_USD_PER_MTOK:g} USD: {usd}")


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
        """The spend of the stream ``meta`` names (served by ``meta.provider``), with what
        its failed attempts may have cost (:meth:`failed`)."""
        served = f"{meta.provider}/{meta.upstream_model}"
        price = self.price(served, meta.model)
        spend = spend_of(
            tallied,
            price,
            complete=complete,
            prompt_estimate=meta.prompt_estimate,
            prompt_audio_estimate=meta.prompt_audio_estimate,
            accepted=meta.upstream_accepted,
            upstream_prompt=meta.upstream_prompt,
        )
        if meta.failed_attempts:
            spend = replace(spend, failed_attempts=self.failed(meta))
        return spend

    def failed(self, meta: StreamMeta) -> FailedAttempts:
        """What the failed attempts ``meta`` lists may have cost (:class:`FailedAttempts`)."""
        tokens, cost = 0, None
        for attempt in meta.failed_attempts:
            usage = attempt.prompt
            prompt = meta.prompt_estimate if usage is None else usage.prompt_tokens
            tokens += prompt
            price = self.price(attempt.target, meta.model)
            if price is not None:
                cached = 0 if usage is None else usage.cached_tokens or 0
                written = 0 if usage is None else usage.cache_write_tokens or 0
                long = 0 if usage is None else usage.cache_write_1h_tokens or 0
                heard = meta.prompt_audio_estimate if usage is None else usage.prompt_audio_tokens
                cost = (cost or 0.0) + cost_usd(
                    price, prompt, 0, cached, written, heard or 0, long=long
                )
        return FailedAttempts(len(meta.failed_attempts), tokens, cost)


def cost_usd(
    price: Price,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    cache_write_tokens: int = 0,
    prompt_audio_tokens: int = 0,
    completion_audio_tokens: int = 0,
    *,
    long: int = 0,
) -> float:
    """The cost of these tokens at ``price`` (the module's formula): a finite number.
    Cached and written tokens beyond the prompt, and audio tokens beyond what is left of
    the prompt or beyond the completion, count as the plain tokens they are part of (an
    upstream that reports more of them is not trusted); each count is taken between 0
    and :data:`~nexus.events.MAX_TOKENS` (the upstream decoders refuse others; this holds
    for any caller; the prompt, Anthropic's input, cache reads and writes together, up to
    three times it)."""
    prompt = _bounded(prompt_tokens, 3)
    cached = min(_bounded(cached_tokens), prompt)
    written = min(_bounded(cache_write_tokens), prompt - cached)
    long = min(_bounded(long), written)  # of them, written for an hour
    plain = prompt - cached - written
    heard = min(_bounded(prompt_audio_tokens), plain)
    completion = _bounded(completion_tokens)
    spoken = min(_bounded(completion_audio_tokens), completion)
    text_in, text_out = price.input_usd_per_mtok, price.output_usd_per_mtok
    write_price = price.cache_write_usd_per_mtok
    audio_in, audio_out = price.audio_input_usd_per_mtok, price.audio_output_usd_per_mtok
    micro = (
        (plain - heard) * text_in
        + heard * (text_in if audio_in is None else audio_in)
        + cached * price.cached_input_usd_per_mtok
        + (written - long) * (text_in if write_price is None else write_price)
        + long * price.long_write
        + (completion - spoken) * text_out
        + spoken * (text_out if audio_out is None else audio_out)
    )
    return micro / PER_TOKENS


def _bounded(tokens: int, counts: int = 1) -> int:
    return min(max(tokens, 0), counts * MAX_TOKENS)


_BILLED_ELSEWHERE = {
    "plugins": "plugins (web search, file parsing) are billed per call",
    "models": "fallback models are billed at their own prices",
}
"""Fields a compatible upstream (OpenRouter) bills by, beyond the listed price."""

_TIERS_AT_PRICE = (None, "auto", "default", "flex", "standard_only")
"""``service_tier`` values billed at most at the model's listed price."""


def unpriced(request: ChatRequest, prices: Sequence[Price | None]) -> tuple[str, str] | None:
    """What in ``request`` the upstream bills beyond ``prices`` (those of its model's
    targets): a dearer tier, per-call fees, audio tokens where a price has no audio price
    for them, as (``param``, why); None when nothing is. A key with a budget is refused
    such a request: its cost could not be held nor charged right. So is an earlier audio
    answer named by its id, even at audio prices: like a file sent by id, its length is
    the upstream's to know, and the budget could not hold it."""
    extra = request.model_extra or {}
    tier = extra.get("service_tier")
    if tier not in _TIERS_AT_PRICE:
        return "service_tier", f"the service tier {tier!r} is billed above the listed price"
    if "web_search_options" in extra:
        return "web_search_options", "web searches are billed per call"
    for name, why in _BILLED_ELSEWHERE.items():  # (OpenRouter's, passed on as they came)
        if extra.get(name):
            return name, why
    if extra.get("inference_geo") is not None:  # Anthropic: US-only inference at 1.1x
        return "inference_geo", "inference held to one region is billed above the listed price"
    if _asks_audio(request) and not all(
        price is not None and price.audio_output_usd_per_mtok is not None for price in prices
    ):
        return "modalities", "audio output is billed per audio token (audio_output_usd_per_mtok)"
    heard = all(
        price is not None and price.audio_input_usd_per_mtok is not None for price in prices
    )
    for index, message in enumerate(request.messages):
        if isinstance(message, AssistantMessage) and audio_reference(message):
            why = (
                "audio named by its id is counted by the upstream only"
                if heard
                else "audio input is billed per audio token (audio_input_usd_per_mtok)"
            )
            return f"messages[{index}].audio", why
        content = message.content
        for part in content if isinstance(content, list) else ():
            if isinstance(part, AudioPart) and not heard:
                why = "audio input is billed per audio token (audio_input_usd_per_mtok)"
                return f"messages[{index}]", why
            if isinstance(part, FilePart) and not _inline(part):
                return f"messages[{index}]", "a file sent by id is counted by the upstream only"
    return None


def _inline(part: FilePart) -> bool:
    """Whether the file is in the request (its estimate counts it): its data, or a
    ``/v1/messages`` document of ``content`` text blocks; not one by id or by URL, nor one
    holding images (by URL or id, which its estimate would count as their JSON)."""
    if isinstance(part.file.get("file_data"), str):
        return True
    sent = (part.model_extra or {}).get("anthropic_document")
    source = sent.get("source") if isinstance(sent, dict) else None
    if not isinstance(source, dict) or source.get("type") != "content":
        return False
    blocks = source.get("content")
    return isinstance(blocks, list) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in blocks
    )


def _asks_audio(request: ChatRequest) -> bool:
    """Whether ``request`` asks for audio output (``modalities`` with ``audio``, or ``audio``)."""
    extra = request.model_extra
    if not extra:
        return False
    modalities = extra.get("modalities")
    return "audio" in extra or (isinstance(modalities, list) and "audio" in modalities)


def worst_cost(request: ChatRequest, prices: Sequence[Price | None]) -> float:
    """The most ``request`` can cost at the dearest of ``prices`` (None: unpriced, 0):
    its :func:`prompt_estimate` at the dearer of the input and cache-write prices, its
    audio (:func:`prompt_audio_estimate`) at the audio input price if dearer still, and
    its whole output cap (``token_limit``; none counts 0), at the audio output price if
    dearer when it asks for audio. What a budget holds for it while it runs: an estimate's
    error (images, scripts other than Latin, audio) is the only slack."""
    prompt = prompt_estimate(request)
    heard = prompt_audio_estimate(request)
    output = request.token_limit or 0
    speaks = _asks_audio(request)
    long = _asks_long_cache(request)
    worst = 0.0
    for price in prices:
        if price is not None:
            per_prompt = max(price.input_usd_per_mtok, price.cache_write_usd_per_mtok or 0.0)
            if long:  # an hour's cache write, dearer still
                per_prompt = max(per_prompt, price.long_write)
            per_heard = max(per_prompt, price.audio_input_usd_per_mtok or 0.0)
            per_output = price.output_usd_per_mtok
            if speaks:
                per_output = max(per_output, price.audio_output_usd_per_mtok or 0.0)
            usd = (
                (prompt - heard) * per_prompt + heard * per_heard + output * per_output
            ) / PER_TOKENS
            worst = max(worst, usd)
    return worst


def _asks_long_cache(request: ChatRequest) -> bool:
    """Whether a cache mark of ``request`` asks for an hour (``"ttl": "1h"``): the prompt
    may then be written at that dearer price."""
    return any(type(mark) is dict and mark.get("ttl") == "1h" for mark in _marks(request))


def _marks(request: ChatRequest) -> Iterator[Any]:
    """Every ``cache_control`` a request carries: top-level, on tools, messages, parts and
    the blocks a ``/v1/messages`` client sent."""
    yield (request.model_extra or {}).get("cache_control")
    for tool in request.tools or ():
        yield (tool.model_extra or {}).get("cache_control")
    for message in request.messages:
        extra = message.model_extra or {}
        yield extra.get("cache_control")
        for block in (
            *(extra.get("anthropic_content") or ()),
            *(extra.get("tool_result_content") or ()),
        ):
            yield block.get("cache_control") if type(block) is dict else None
        for part in message.content if isinstance(message.content, list) else ():
            given = part.model_extra or {}
            yield given.get("cache_control")
            yield (given.get("anthropic_document") or {}).get("cache_control")


@dataclass(slots=True)
class Tally:
    """What a stream's events say of its spend: its last usage, its output events."""

    usage: Usage | None = None
    pieces: int = 0
    """Output events seen that carry text (content, refusal, reasoning, a tool call, a piece
    of a transcript): a token each at least, as OpenAI streams them."""
    text_bytes: int = 0
    """Their text's UTF-8 bytes: a token per :data:`~nexus.estimates.CHARS_PER_TOKEN`, as
    a prompt is estimated (Anthropic's pieces, and others', hold several tokens)."""
    spoken: int = 0
    """The audio's tokens: its duration's (:data:`SPOKEN_BYTES_PER_TOKEN`)."""
    answered: bool = False
    """The upstream sent an event (it accepted the request: its prompt is billed)."""
    spoken_bytes: int = 0
    """The audio's bytes seen."""

    @property
    def produced(self) -> int:
        """Output tokens seen: the larger of a token a text piece and a token per
        :data:`~nexus.estimates.CHARS_PER_TOKEN` bytes of their text, and the audio's."""
        return max(self.pieces, -(-self.text_bytes // CHARS_PER_TOKEN)) + self.spoken

    def add(self, event: StreamEvent) -> None:
        self.answered = True
        cls = type(event)
        if cls is Usage:
            self.usage = event  # type: ignore[assignment]
        elif cls is Delta:
            text = event.content  # type: ignore[union-attr]
            if event.refusal is None and event.tool_calls is None:  # type: ignore[union-attr]
                if text:  # the commonest: a token of text
                    self.pieces += 1
                    self.text_bytes += len(text) if text.isascii() else len(text.encode())
                return
            text = (text or "") + (event.refusal or "")  # type: ignore[union-attr]
            for call in event.tool_calls or ():  # type: ignore[union-attr]
                text += (call.name or "") + call.arguments
            if text or event.tool_calls:  # type: ignore[union-attr]
                self.pieces += 1
                self.text_bytes += len(text.encode())
        elif cls is Reasoning:
            self.pieces += 1
            self.text_bytes += len(event.text.encode())  # type: ignore[union-attr]
        elif cls is ToolCall:
            self.pieces += 1
            self.text_bytes += len(((event.name or "") + event.arguments).encode())  # type: ignore[union-attr]
        elif cls is Audio:
            data = event.data  # type: ignore[union-attr]
            if data is None:  # a piece of the transcript (or the id, the expiry)
                self.pieces += 1
                self.text_bytes += len((event.transcript or "").encode())  # type: ignore[union-attr]
            else:
                self.spoken_bytes += spoken_bytes(data)
                self.spoken = -(-self.spoken_bytes // SPOKEN_BYTES_PER_TOKEN)


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


def spend_of(
    tallied: Tally,
    price: Price | None,
    *,
    complete: bool,
    prompt_estimate: int = 0,
    prompt_audio_estimate: int = 0,
    accepted: bool = False,
    upstream_prompt: Usage | None = None,
) -> Spend:
    """The :class:`Spend` of a stream; ``complete``: its last usage is the final count.
    ``prompt_estimate``: the prompt of a stream the upstream answered without a usage,
    ``prompt_audio_estimate`` of it audio; ``accepted``: an upstream took the request,
    though no event came from it; ``upstream_prompt``: then, the prompt's counts it gave
    (charged, not the estimate). The one computation of a cost from counts: a usage's
    own ``cost_usd`` is this of a complete tally of it."""

    usage = tallied.usage
    if usage is not None:
        prompt = usage.prompt_tokens
        completion = usage.completion_tokens
        cached = usage.cached_tokens or 0
        written = usage.cache_write_tokens or 0
        long = usage.cache_write_1h_tokens or 0
        reasoning = usage.reasoning_tokens or 0
        heard = usage.prompt_audio_tokens or 0
        spoken = usage.completion_audio_tokens or 0
        estimated = False
        if not complete and tallied.produced > completion:
            completion, estimated = tallied.produced, True
            spoken = max(spoken, tallied.spoken)
    else:
        if upstream_prompt is not None:
            prompt = upstream_prompt.prompt_tokens
            cached = upstream_prompt.cached_tokens or 0
            written = upstream_prompt.cache_write_tokens or 0
            long = upstream_prompt.cache_write_1h_tokens or 0
            heard = upstream_prompt.prompt_audio_tokens or 0
        elif tallied.answered or accepted:
            # Accepted (an event came, or a 2xx) but cut before a usage: the prompt is billed.
            prompt, heard, cached, written = prompt_estimate, prompt_audio_estimate, 0, 0
            long = 0
        else:
            prompt = heard = cached = written = long = 0
        reasoning, completion, spoken, estimated = 0, tallied.produced, tallied.spoken, True
    cost = (
        None
        if price is None
        else cost_usd(price, prompt, completion, cached, written, heard, spoken, long=long)
    )
    return Spend(prompt, completion, cached, reasoning, cost, estimated, written, heard, spoken)


def terminal_ok(event: StreamEvent) -> bool:
    """Whether a stream that ended with ``event`` completed (not failed, not aborted)."""
    if type(event) is Error:
        return False
    return not (type(event) is Done and event.aborted)

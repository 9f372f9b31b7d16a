"""Shared value types: a stream's identity and the merged completion."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from .events import Audio, Citation, Image, Usage

__all__ = [
    "CompletedToolCall",
    "Completion",
    "FailedAttempt",
    "ReasoningBlock",
    "StreamMeta",
    "fallback_call_id",
    "new_stream_id",
    "stream_id_of",
]


def new_stream_id(prefix: str = "chatcmpl-") -> str:
    """An unguessable stream id: 128 random bits, hex."""
    return prefix + os.urandom(16).hex()


def stream_id_of(name: str) -> str:
    """The stream a client's id names: a Responses ``resp_<hex>`` (what a ``background``
    response is called) is the stream ``chatcmpl-<hex>``; any other is itself."""
    if name.startswith("resp_"):
        return "chatcmpl-" + name[5:]
    return name


def fallback_call_id(stream_id: str, index: int) -> str:
    """The id of a tool call its upstream sent without one: ``call_<end of the stream id>_
    <index>``, the same in every format, streamed or not, and unlike any other stream's (the
    client sends it back with the call's result, so it must not repeat across turns)."""
    return f"call_{stream_id[-12:]}_{index}"


@dataclass(frozen=True, slots=True)
class FailedAttempt:
    """An upstream attempt that failed after its upstream took the request (a 2xx), before
    any event came from it: the router went on to the next target, or ended with the
    error. The upstream may bill its prompt; Nexus logs and counts what it may have cost
    (:class:`~nexus.pricing.FailedAttempts`) and charges it to no budget."""

    target: str
    """``provider/model``: the target tried (its price applies)."""
    prompt: Usage | None = None
    """The prompt's counts the upstream gave before it failed (Anthropic's
    ``message_start``); None: the stream's prompt estimate stands for them."""


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """What every frame of one stream shares. ``model`` is the name the client asked for
    (an alias stays one); ``provider`` and ``upstream_model`` say where it was routed."""

    id: str
    model: str
    created: int
    include_usage: bool = False
    provider: str = ""
    upstream_model: str = ""
    retry_ms: int | None = None
    include_cost: bool = False
    """The listener asked for ``usage.cost`` (``stream_options.include_cost``)."""
    include_obfuscation: bool = False
    """The listener asked for padded chunks (``stream_options.include_obfuscation``)."""
    joined: bool = False
    """The listener joined a stream another request runs and is charged: its request is
    charged nothing, so the cost it is shown is 0.0 (as a replay's). Not stored."""
    prompt_estimate: int = 0
    """The request's prompt in tokens, estimated (:func:`nexus.estimates.prompt_estimate`):
    charged to a stream its upstream answered without reporting a usage (cut before it).
    Not kept in a shared store: the replica that runs the stream charges it."""
    prompt_audio_estimate: int = 0
    """Of it, the tokens of its audio parts (:func:`nexus.estimates.prompt_audio_estimate`),
    charged at the audio input price. Not kept in a shared store either."""
    upstream_accepted: bool = False
    """An upstream took the request (it answered 2xx), so bills its prompt, though the
    stream ended before any event came (a client that left during a long prefill or
    reasoning): the prompt's estimate is charged. Set when such a stream ends."""
    upstream_prompt: Usage | None = None
    """The upstream's own count of the prompt, when it gave one before any event came
    (Anthropic's ``message_start``): charged, in place of the estimate, to a stream that
    ended then. Set when such a stream ends."""
    failed_attempts: tuple[FailedAttempt, ...] = ()
    """The attempts that failed after their upstream took the request, in order: logged
    and counted, never charged (:class:`FailedAttempt`). Set as each fails."""
    echo: dict[str, Any] | None = None
    """A ``/v1/responses`` request's fields its ``response`` object echoes (its
    ``responses_echo``): kept with the stream, for every answer that shows it."""

    @classmethod
    def new(cls, model: str, **kwargs: object) -> StreamMeta:
        return cls(id=new_stream_id(), model=model, created=int(time.time()), **kwargs)  # type: ignore[arg-type]


@dataclass(slots=True)
class CompletedToolCall:
    index: int
    id: str
    name: str
    arguments: str
    extra_content: dict[str, Any] | None = None
    """What the upstream attached to it for its next turn (:class:`~nexus.events.ToolCall`)."""


@dataclass(slots=True)
class ReasoningBlock:
    """One block of reasoning as the provider gave it (an Anthropic ``thinking`` or
    ``redacted_thinking`` block): its ``text`` and the ``signature`` that seals it, or the
    encrypted ``redacted`` data of a block without text. A provider checks each against its
    seal when it comes back in a later turn, so blocks are kept apart, never merged.
    ``after``: how many text runs and tool calls came before it."""

    text: str = ""
    signature: str | None = None
    redacted: str | None = None
    after: int = 0


@dataclass(slots=True)
class Completion:
    """The merged result of a stream (what :func:`nexus.accumulate` returns)."""

    id: str
    model: str
    created: int
    role: str = "assistant"
    content: str = ""
    reasoning: str = ""
    reasoning_signature: str | None = None
    refusal: str | None = None
    tool_calls: list[CompletedToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None
    """The stop sequence that ended the turn, when the provider said which."""
    stop_reason: str | None = None
    """Anthropic's own stop reason, where ``finish_reason`` says less (:class:`Delta`)."""
    usage: Usage | None = None
    citations: list[Citation] = field(default_factory=list)
    audio: list[Audio] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)
    text_runs: list[tuple[int, str]] = field(default_factory=list)
    """``content`` in the runs it came in, each with the count of tool calls begun before
    it: for the shapes that keep text and tool calls in their order (Anthropic's content
    blocks, the Responses output items)."""
    reasoning_blocks: list[ReasoningBlock] = field(default_factory=list)
    """The reasoning block by block, each with its own signature, placed among the text
    runs and tool calls (``reasoning`` is their text joined, ``reasoning_signature`` the
    last signature)."""
    cited_runs: list[int] = field(default_factory=list)
    """Of each citation, the text run it goes with (its index in :attr:`text_runs`)."""
    echo: dict[str, Any] | None = None
    """The stream's :attr:`StreamMeta.echo`: what a Responses answer echoes of its request."""

    def cited(self) -> list[tuple[Citation, int]]:
        """Each citation with the text run it goes with (the first when not known, the last
        for one no text came after)."""
        runs, last = self.cited_runs, max(len(self.text_runs) - 1, 0)
        return [
            (c, min(runs[i], last) if i < len(runs) else 0) for i, c in enumerate(self.citations)
        ]


Item = tuple[str, str | None] | CompletedToolCall | ReasoningBlock
"""What :func:`in_order` lists."""


def in_order(completion: Completion) -> list[Item]:
    """The completion's reasoning blocks, text and tool calls in the order they came, for
    the shapes that keep it (Anthropic's content blocks, the Responses output items): each
    text run as (text, refusal), the refusal on the last run (one of its own before the
    calls when there is no text). A completion made without :attr:`~Completion.text_runs`
    (by hand) has its ``content`` as one run before its calls, and without
    :attr:`~Completion.reasoning_blocks` its ``reasoning`` as one block before all."""
    runs = completion.text_runs or ([(0, completion.content)] if completion.content else [])
    if completion.refusal and not runs:
        runs = [(0, "")]
    calls = completion.tool_calls
    items: list[Item] = []
    done = 0
    for at, (before, text) in enumerate(runs):
        items += calls[done:before]
        done = max(done, before)
        items.append((text, completion.refusal if at == len(runs) - 1 else None))
    items += calls[done:]
    blocks = completion.reasoning_blocks
    if not blocks and completion.reasoning:
        blocks = [ReasoningBlock(completion.reasoning, completion.reasoning_signature)]
    for placed, block in enumerate(blocks):  # each after the items that came before it
        items.insert(min(block.after + placed, len(items)), block)
    return items

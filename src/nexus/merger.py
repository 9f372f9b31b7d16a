"""Folding a completion's events into one :class:`~nexus.types.Completion`: what
:func:`nexus.accumulate`, the end hooks' ``final`` and the non-streaming answers read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .events import Audio, Citation, Delta, Image, Reasoning, StreamEvent, ToolCall, Usage
from .types import CompletedToolCall, Completion, ReasoningBlock, StreamMeta, fallback_call_id

__all__ = ["Merger", "merge_events"]


class _ToolCallBuilder:
    __slots__ = ("arguments", "extra", "id", "index", "name")

    def __init__(self, index: int) -> None:
        self.index = index
        self.id: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []
        self.extra: dict[str, Any] | None = None


class _ReasoningBuilder:
    __slots__ = ("after", "pieces", "redacted", "signature")

    def __init__(self, after: int, redacted: str | None = None) -> None:
        self.after = after
        self.pieces: list[str] = []
        self.signature: str | None = None
        self.redacted = redacted


def merge_events(events: Iterable[StreamEvent], meta: StreamMeta) -> Completion:
    """:func:`accumulate` for events already at hand (an :class:`Error` among them is skipped)."""
    merger = Merger(meta)
    for event in events:
        merger.add(event)
    return merger.result()


class Merger:
    """Folds events into a :class:`~nexus.types.Completion`, one :meth:`add` at a time."""

    def __init__(self, meta: StreamMeta) -> None:
        self.meta = meta
        self._content: list[str] = []
        self._runs: list[tuple[int, list[str]]] = []  # (tool calls before, its pieces)
        self._run_open = False  # more content joins the last run
        self._reasoning: list[str] = []
        self._blocks: list[_ReasoningBuilder] = []
        self._block: _ReasoningBuilder | None = None  # the reasoning block more text joins
        self._refusal: list[str] = []
        self._calls: dict[int, _ToolCallBuilder] = {}  # by the upstream's index: its latest
        self._built: list[_ToolCallBuilder] = []  # every call, in the order they began
        self._by_id: dict[str, _ToolCallBuilder] = {}
        self._result = Completion(
            id=meta.id, model=meta.model, created=meta.created, echo=meta.echo
        )

    def _merge(self, call: ToolCall) -> None:
        builder = self._by_id.get(call.id) if call.id is not None else None
        if builder is None:
            builder = self._calls.get(call.index)
            if builder is None or (call.id is not None and builder.id not in (None, call.id)):
                # A call of its own, though some upstreams give every call the same index
                # (or none): its arguments must not join another's. It takes that index
                # for the fragments after it, and sorts after every call before it.
                index = call.index if builder is None else self._top() + 1
                builder = self._calls[call.index] = _ToolCallBuilder(index)
                self._built.append(builder)
                self._block = None
        if call.id is not None and builder.id is None:
            builder.id = call.id
            self._by_id[call.id] = builder
        if call.name is not None and builder.name is None:
            builder.name = call.name
        if call.arguments:
            builder.arguments.append(call.arguments)
        if call.extra_content is not None:
            builder.extra = call.extra_content

    def _top(self) -> int:
        return max(builder.index for builder in self._built)

    def _think(self, event: Reasoning) -> None:
        """A reasoning block begins with reasoning after anything else, and ends with its
        signature; a redacted one is whole."""
        redacted = event.redacted is not None
        if not (event.text or event.signature is not None or redacted):
            return
        self._run_open = False
        block = self._block
        if block is None or redacted:
            block = _ReasoningBuilder(len(self._runs) + len(self._built), event.redacted)
            self._blocks.append(block)
        if event.text:
            self._reasoning.append(event.text)
            block.pieces.append(event.text)
        if event.signature is not None:
            block.signature = event.signature
            self._result.reasoning_signature = event.signature
        self._block = None if event.signature is not None or redacted else block

    def add(self, event: StreamEvent) -> None:
        result = self._result
        match event:
            case Delta():
                if event.content:
                    self._content.append(event.content)
                    runs, calls = self._runs, len(self._built)
                    if self._run_open and runs[-1][0] == calls:
                        runs[-1][1].append(event.content)
                    else:
                        runs.append((calls, [event.content]))
                        self._run_open = True
                        self._block = None
                if event.refusal:
                    self._refusal.append(event.refusal)
                if event.role is not None:
                    result.role = event.role
                for call in event.tool_calls or ():
                    self._merge(call)
                if event.finish_reason is not None:
                    result.finish_reason = event.finish_reason
                    result.stop_sequence = event.stop_sequence
                    result.stop_reason = event.stop_reason
            case Reasoning():
                self._think(event)
            case ToolCall():
                self._merge(event)
            case Usage():
                # The totals come last; an early partial count never replaces them.
                if not event.partial or result.usage is None or result.usage.partial:
                    result.usage = event
            case Citation():
                # Anthropic sends a block's citations before its text: one that comes while
                # no text runs is the next run's.
                result.citations.append(event)
                runs = self._runs
                going = self._run_open and runs and runs[-1][0] == len(self._built)
                result.cited_runs.append(len(runs) - 1 if going else len(runs))
            case Audio():
                result.audio.append(event)
            case Image():
                result.images.append(event)

    def result(self) -> Completion:
        result = self._result
        meta = self.meta
        result.content = "".join(self._content)
        result.text_runs = [(calls, "".join(pieces)) for calls, pieces in self._runs]
        result.reasoning = "".join(self._reasoning)
        result.reasoning_blocks = [
            ReasoningBlock("".join(b.pieces), b.signature, b.redacted, b.after)
            for b in self._blocks
        ]
        result.refusal = "".join(self._refusal) if self._refusal else None
        result.tool_calls = [
            CompletedToolCall(
                index=b.index,
                id=b.id or fallback_call_id(meta.id, b.index),
                name=b.name or "",
                # A call without arguments is "{}", as OpenAI sends it, whatever the
                # upstream sent ("" or nothing): an empty string is not JSON.
                arguments="".join(b.arguments) or "{}",
                extra_content=b.extra,
            )
            for b in sorted(self._built, key=lambda b: b.index)
        ]
        return result

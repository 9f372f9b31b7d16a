"""One stream's tool-call pieces as OpenAI-compatible servers send them, read as every
client reads them (:class:`ToolCallPieces`). Sans-I/O."""

from __future__ import annotations

from ..events import ToolCall

__all__ = ["ToolCallPieces"]


class ToolCallPieces:
    """One stream's tool-call pieces, as every client reads them: a call's first piece
    carries its id and name, the next ones only more arguments, each call an index of its
    own. Upstreams differ (docs/protocols.md §2): some send ``"id": ""`` on the next
    pieces (Qwen), some repeat the id and name on every piece (which the OpenAI SDK's
    stream helper would concatenate: ``call_Acall_A``), some give parallel calls one index,
    or none (Gemini's OpenAI-compatible API), which would run their arguments together."""

    __slots__ = ("_at", "_used")

    def __init__(self) -> None:
        self._at: dict[int, tuple[int, str | None, str | None]] = {}
        """The upstream's index -> the call it is now: its index here, id and name."""
        self._used: set[int] = set()

    def __call__(self, piece: ToolCall) -> ToolCall:
        piece_id = piece.id or None  # "" names no call
        at = self._at.get(piece.index)
        if at is not None:
            index, known_id, known_name = at
            if piece_id is None or known_id is None or piece_id == known_id:  # the same call
                new_id = piece_id if known_id is None else None  # an id it had not sent yet
                name = None if piece.name == known_name else piece.name
                self._at[piece.index] = (index, known_id or new_id, known_name or name)
                if (index, new_id, name) == (piece.index, piece.id, piece.name):
                    return piece
                return ToolCall(index, new_id, name, piece.arguments, piece.extra_content)
        # A call of its own: the upstream's index, unless another call here has it.
        index = piece.index if piece.index not in self._used else max(self._used) + 1
        self._used.add(index)
        self._at[piece.index] = (index, piece_id, piece.name)
        if index == piece.index and piece_id == piece.id:
            return piece
        return ToolCall(index, piece_id, piece.name, piece.arguments, piece.extra_content)

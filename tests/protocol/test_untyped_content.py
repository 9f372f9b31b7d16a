"""A text that is not a string (a number, a list of parts, an object: a compatible server's
extension, or a bug) is passed on as it came, as before the shared content deltas: the
decoders do not raise on it."""

from __future__ import annotations

import orjson
import pytest

from nexus.events import Delta
from nexus.protocol.anthropic_events import EventDecoder
from nexus.protocol.openai_chunks import ChunkDecoder

ODD = [1.5, 7, ["x y"], {"type": "text", "text": "hi"}, True]


@pytest.mark.parametrize("content", ODD)
def test_openai_content_that_is_no_string(content: object) -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": content}}]}
    decoder = ChunkDecoder("p")
    assert decoder.decode(b"data: " + orjson.dumps(chunk) + b"\n\n") == [Delta(content)]  # type: ignore[arg-type]
    assert decoder.error is None


@pytest.mark.parametrize("text", ODD)
def test_anthropic_text_that_is_no_string(text: object) -> None:
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": text},
    }
    frame = b"event: content_block_delta\ndata: " + orjson.dumps(delta) + b"\n\n"
    decoder = EventDecoder("claude")
    assert decoder.decode(frame) == [Delta(text)]  # type: ignore[arg-type]

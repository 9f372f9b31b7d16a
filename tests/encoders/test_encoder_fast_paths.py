"""Each built-in encoder frames a delta that carries only content (the commonest event)
with bytes it prepared, around one ``dumps`` of the text. That path is held here to the
encoder's general one: the same bytes, event for event, whatever came before."""

from __future__ import annotations

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.encoders import (
    AnthropicSSEEncoder,
    NativeSSEEncoder,
    NDJSONEncoder,
    OpenAISSEEncoder,
    ResponsesSSEEncoder,
)
from nexus.encoders.base import Encoder
from nexus.events import Citation, Delta, Reasoning, StreamEvent, ToolCall, Usage
from nexus.types import StreamMeta

ENCODERS: list[type[Encoder]] = [
    OpenAISSEEncoder,
    NativeSSEEncoder,
    NDJSONEncoder,
    AnthropicSSEEncoder,
    ResponsesSSEEncoder,
]
META = StreamMeta(id="chatcmpl-0123456789abcdef01234567", model="m", created=1, include_usage=True)

text = st.text(st.characters(codec="utf-8"), max_size=12)
content = st.builds(Delta, text)  # the fast path's event (empty text too)
events = st.one_of(
    content,
    content,
    content,
    st.builds(Delta, text, refusal=text),
    st.builds(Delta, finish_reason=st.sampled_from(["stop", "length", "tool_calls"])),
    st.builds(Delta, text, role=st.just("assistant")),
    st.builds(Reasoning, text),
    st.builds(ToolCall, st.integers(0, 2), st.sampled_from([None, "call_1"]), st.just("f"), text),
    st.builds(Usage, st.integers(0, 9), st.integers(0, 9), st.integers(0, 18)),
    st.builds(Citation, st.just("https://example.com"), text),
)


def frames(encoder_cls: type[Encoder], log: list[StreamEvent]) -> list[bytes]:
    encoder = encoder_cls(META)
    return [encoder.start(), *(encoder.encode(event) for event in log), encoder.end()]


@settings(max_examples=150, deadline=None)
@given(log=st.lists(events, max_size=25))
def test_the_content_frame_is_the_general_paths(log: list[StreamEvent]) -> None:
    for encoder_cls in ENCODERS:
        fast = frames(encoder_cls, log)
        # Without it (no event is "only content"), every event takes the general path.
        with mock.patch(f"{encoder_cls.__module__}.plain_content", return_value=None):
            general = frames(encoder_cls, log)
        assert fast == general, encoder_cls.__name__

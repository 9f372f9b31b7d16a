"""Extended thinking through ``/v1/messages`` over an Anthropic upstream, with the anthropic
SDK: every thinking block keeps its own signature and its place among the tool calls and
text, redacted thinking comes through whole, streamed or not, and both go back upstream
unmodified and in order in the next turn of a tool loop (Anthropic checks them)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from support import MakeClient
from upstreams import FakeUpstream, Reply, anthropic_stream

USER = [{"role": "user", "content": "What time is it?"}]
THINKING = {"type": "enabled", "budget_tokens": 1024}
A = {"type": "thinking", "thinking": "Check the clock.", "signature": "SIG_A"}
B = {"type": "thinking", "thinking": "Now answer.", "signature": "SIG_B"}
REDACTED = {"type": "redacted_thinking", "data": "ENCRYPTED_BLOB"}
TOOL = {"type": "tool_use", "id": "toolu_1", "name": "clock", "input": {"tz": "UTC"}}
TEXT = {"type": "text", "text": "Noon."}


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


async def sdk(make_client: MakeClient, upstream: FakeUpstream) -> anthropic.AsyncAnthropic:
    config = {"providers": {"an": {"kind": "anthropic", "base_url": upstream.url}}}
    client = await make_client(config)
    return anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")), api_key="unused", max_retries=0
    )


async def both(api: anthropic.AsyncAnthropic, blocks: list[dict[str, Any]]) -> list[Any]:
    """The content the SDK makes of ``blocks`` streamed, then not."""
    request: Any = {"model": "an/claude", "max_tokens": 2048, "messages": USER}
    async with api.messages.stream(**request, thinking=THINKING) as stream:
        streamed = await stream.get_final_message()
    created = await api.messages.create(**request, thinking=THINKING)
    return [[b.model_dump(exclude_none=True) for b in m.content] for m in (streamed, created)]


@pytest.mark.parametrize(
    "blocks",
    [
        pytest.param([A, TOOL, B], id="interleaved-with-a-tool-call"),
        pytest.param([A, B, TEXT], id="one-after-another"),
        pytest.param([A, REDACTED, TEXT], id="redacted"),
        pytest.param([REDACTED, TOOL], id="redacted-alone"),
    ],
)
async def test_thinking_blocks_reach_the_sdk_as_sent_streamed_or_not(
    make_client: MakeClient, upstream: FakeUpstream, blocks: list[dict[str, Any]]
) -> None:
    stop = "tool_use" if TOOL in blocks else "end_turn"
    frames = anthropic_stream(blocks, stop)
    upstream.add(Reply.stream(frames), Reply.stream(frames))
    api = await sdk(make_client, upstream)
    streamed, created = await both(api, blocks)
    assert streamed == blocks
    assert created == blocks
    await api.close()


async def test_thinking_goes_back_upstream_unmodified_in_its_place(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """The next turn of a tool loop carries the assistant's blocks as the upstream sent
    them: signed and redacted thinking, each where it was among the tool calls."""
    blocks = [A, REDACTED, TOOL, B]
    upstream.add(
        Reply.stream(anthropic_stream(blocks, "tool_use")),
        Reply.stream(anthropic_stream([TEXT])),
    )
    api = await sdk(make_client, upstream)
    first = await api.messages.create(
        model="an/claude", max_tokens=2048, messages=USER, thinking=THINKING
    )
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}
    turn: Any = [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    await api.messages.create(model="an/claude", max_tokens=2048, messages=turn, thinking=THINKING)
    sent = upstream.requests[1].body["messages"]
    assert sent[1] == {"role": "assistant", "content": blocks}
    await api.close()

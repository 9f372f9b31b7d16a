"""``/v1/messages`` streamed and not give the anthropic SDK the same message: the stop
sequence that ended it, a refusal's text, tool calls whose arguments are not JSON, and the
ids of tool calls the upstream left without one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, anthropic_stream, openai_chunk

USER = [{"role": "user", "content": "one two three four"}]


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


async def both(api: Any, **request: Any) -> tuple[Any, Any]:
    """The message of one request, streamed, then not."""
    async with api.messages.stream(**request) as stream:
        streamed = await stream.get_final_message()
    return streamed, await api.messages.create(**request)


async def sdk(make_client: MakeClient, config: dict[str, Any] | None = None) -> Any:
    client = await make_client(config)
    return anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")), api_key="unused", max_retries=0
    )


async def test_a_stop_sequence_hit_names_the_sequence(make_client: MakeClient) -> None:
    api = await sdk(make_client)
    request = {"model": "mock/echo", "max_tokens": 50, "messages": USER}
    for message in await both(api, **request, stop_sequences=["zzz", "three"]):
        assert message.content[0].text == "one two "
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "three")
    for message in await both(api, **request, stop_sequences=["absent"]):
        assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    await api.close()


async def test_a_refusal_is_text_in_both_forms(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    frames = [
        openai_chunk(role="assistant", content=""),
        openai_chunk(content="Well. "),
        openai_chunk(refusal="I can't help with that."),
        openai_chunk(finish_reason="content_filter"),
        DONE,
    ]
    upstream.add(Reply.stream(frames), Reply.stream(frames))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    api = await sdk(make_client, config)
    streamed, created = await both(api, model="up/m", max_tokens=50, messages=USER)
    assert [b.text for b in streamed.content] == ["Well. I can't help with that."]
    assert [b.text for b in created.content] == ["Well. I can't help with that."]
    assert streamed.stop_reason == created.stop_reason == "refusal"
    await api.close()


async def test_a_forced_tool_that_stopped_is_tool_use(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """OpenAI ends a turn forced to a named tool with ``stop``; Anthropic ends every turn
    that holds ``tool_use`` blocks with ``tool_use``, which is what an agent loop waits for."""
    call = {"index": 0, "id": "call_1", "type": "function"}
    frames = [
        openai_chunk(role="assistant", content=None),
        openai_chunk(tool_calls=[{**call, "function": {"name": "get_weather", "arguments": ""}}]),
        openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city":"Oslo"}'}}]),
        openai_chunk(finish_reason="stop"),
        DONE,
    ]
    plain = [openai_chunk(content="Hi."), openai_chunk(finish_reason="stop"), DONE]
    upstream.add(*(Reply.stream(f) for f in (frames, frames, plain, plain)))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    api = await sdk(make_client, config)
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    request = {"model": "up/m", "max_tokens": 50, "messages": USER, "tools": [tool]}
    forced = {"type": "tool", "name": "get_weather"}
    for message in await both(api, **request, tool_choice=forced):
        assert [b.type for b in message.content] == ["tool_use"]
        assert message.stop_reason == "tool_use"
    for message in await both(api, **request):  # no call: the turn ended
        assert message.stop_reason == "end_turn"
    await api.close()


async def test_a_documents_citations_come_as_anthropic_sent_them_in_both_forms(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A document's ``char_location`` (where in which document) came out as a search
    result's location without its place when streamed, and not at all when not."""
    cited = {
        "type": "char_location",
        "cited_text": "The sky is blue.",
        "document_index": 0,
        "document_title": "Notes",
        "start_char_index": 20,
        "end_char_index": 36,
    }
    blocks = [
        {"type": "text", "text": "Per the notes, "},
        {"type": "text", "text": "the sky is blue.", "citations": [cited]},
    ]
    frames = anthropic_stream(blocks)
    upstream.add(Reply.stream(frames), Reply.stream(frames))
    config = {"providers": {"an": {"kind": "anthropic", "base_url": upstream.url}}}
    api = await sdk(make_client, config)
    for message in await both(api, model="an/claude", max_tokens=50, messages=USER):
        (block,) = message.content
        assert block.text == "Per the notes, the sky is blue."
        assert [c.model_dump(exclude_none=True) for c in block.citations] == [cited]
    # After a tool call, the citation (sent before its block's text) is that block's, not
    # the text before the call's (where the answer not streamed had put it).
    use = {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}
    blocks = [{"type": "text", "text": "Intro. "}, use, blocks[1]]
    frames = anthropic_stream(blocks, stop_reason="end_turn")
    upstream.add(Reply.stream(frames), Reply.stream(frames))
    for message in await both(api, model="an/claude", max_tokens=50, messages=USER):
        first, _, last = message.content
        assert (first.citations, last.text) == (None, "the sky is blue.")
        assert [c.model_dump(exclude_none=True) for c in last.citations] == [cited]
    await api.close()


@pytest.mark.parametrize("arguments", ["not json {", '{"a": 1', '{"a": 1}'])
async def test_tool_arguments_the_sdk_can_read(make_client: MakeClient, arguments: str) -> None:
    """Broken arguments are {"_raw": ...} in both forms (the SDK's stream raised
    ``ValueError: Unable to parse tool parameter JSON``)."""
    api = await sdk(make_client)
    mock = {"tool_calls": [{"name": "f", "arguments": arguments}]}
    streamed, created = await both(
        api, model="mock/echo", max_tokens=50, messages=USER, extra_body={"mock": mock}
    )
    assert streamed.content[-1].input == created.content[-1].input
    assert streamed.content[-1].id == created.content[-1].id
    await api.close()


def tool_turns(result: dict[str, Any]) -> list[dict[str, Any]]:
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    block = {"type": "tool_result", "tool_use_id": "toolu_1", **result}
    return [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [block]}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
FAILED = {"is_error": True, "content": [{"type": "text", "text": "boom"}, IMAGE]}


async def test_an_anthropic_upstream_gets_is_error_and_images_of_a_tool_result(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream([b"event: message_stop\ndata: {}\n\n"]))
    config = {"providers": {"up": {"kind": "anthropic", "base_url": upstream.url}}}
    api = await sdk(make_client, config)
    await api.messages.create(model="up/m", max_tokens=5, messages=tool_turns(FAILED))
    [result] = upstream.requests[0].body["messages"][2]["content"]
    assert result == {"type": "tool_result", "tool_use_id": "toolu_1", **FAILED}
    await api.close()


async def test_an_openai_upstream_gets_is_error_as_text_and_refuses_images(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream([openai_chunk(finish_reason="stop"), DONE]))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    api = await sdk(make_client, config)
    text_only = {"is_error": True, "content": "boom"}
    await api.messages.create(model="up/m", max_tokens=5, messages=tool_turns(text_only))
    tool = upstream.requests[0].body["messages"][2]
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: boom"}
    listed = [{"type": "text", "text": "README.md"}, {"type": "text", "text": "setup.py"}]
    upstream.add(Reply.stream([openai_chunk(finish_reason="stop"), DONE]))
    messages = tool_turns({"content": listed})
    await api.messages.create(model="up/m", max_tokens=5, messages=messages)
    assert upstream.requests[1].body["messages"][2]["content"] == "README.md\nsetup.py"
    with pytest.raises(anthropic.BadRequestError) as info:
        await api.messages.create(model="up/m", max_tokens=5, messages=tool_turns(FAILED))
    assert "holds a block of type 'image'" in info.value.message
    assert len(upstream.requests) == 2
    await api.close()


async def test_an_upstreams_refusal_keeps_its_own_words(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A client reads the upstream's words (Claude Code reads "prompt is too long: N tokens >
    M maximum" to compact the conversation): they came prefixed with "provider 'an'
    answered 400: "."""
    said = "prompt is too long: 210118 tokens > 200000 maximum"
    refusal = {"type": "error", "error": {"type": "invalid_request_error", "message": said}}
    upstream.add(Reply.json(400, refusal))
    config = {"providers": {"an": {"kind": "anthropic", "base_url": upstream.url}}}
    api = await sdk(make_client, config)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await api.messages.create(model="an/claude", max_tokens=5, messages=USER)
    assert refused.value.body["error"]["message"] == said  # type: ignore[index]
    await api.close()

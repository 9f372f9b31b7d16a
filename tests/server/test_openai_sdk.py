"""The official openai SDK against the running gateway: what users will actually run."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import openai
import orjson
import pytest
from openai import AsyncOpenAI

from nexus.events import Citation, Delta, Image, StreamEvent
from nexus.providers.base import Provider
from nexus.request import ChatRequest
from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk

USER = [{"role": "user", "content": "Hello from the SDK"}]


async def sdk(make_client: MakeClient, config: dict[str, Any] | None = None) -> AsyncOpenAI:
    client = await make_client(config)
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


async def test_streamed_text(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        stream = await api.chat.completions.create(model="mock/echo", messages=USER, stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the SDK"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1


async def test_include_usage(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        stream = await api.chat.completions.create(
            model="mock/echo",
            messages=USER,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mock": {"usage": {"cached_tokens": 2}}},
        )
        chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        4,
        4,
        8,
    )
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])


async def test_streamed_tool_calls(make_client: MakeClient) -> None:
    tool_calls = [
        {"name": "get_weather", "arguments": {"city": "Reykjavik", "unit": "celsius"}},
        {"name": "get_time", "arguments": '{"zone": "UTC"}'},
    ]
    async with await sdk(make_client) as api:
        stream = await api.chat.completions.create(
            model="mock/echo",
            messages=USER,
            stream=True,
            extra_body={"mock": {"content": "", "tool_calls": tool_calls}},
        )
        calls: dict[int, dict[str, str]] = {}
        fragments = 0
        finish = None
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                fragments += 1
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                assert delta.function is not None
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert fragments > 4  # the arguments really arrived in pieces
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert orjson.loads(calls[0]["arguments"]) == {"city": "Reykjavik", "unit": "celsius"}
    assert orjson.loads(calls[1]["arguments"]) == {"zone": "UTC"}
    assert all(c["id"].startswith("call_") for c in calls.values())


async def test_stream_helper_accumulates(make_client: MakeClient) -> None:
    """The SDK's strict helper (role once, tool-call indexes in order) accepts our stream."""
    async with (
        await sdk(make_client) as api,
        api.chat.completions.stream(
            model="mock/echo",
            messages=USER,
            extra_body={
                "mock": {
                    "reasoning": "thinking first",
                    "tool_calls": [{"name": "lookup", "arguments": {"q": "nexus"}}],
                }
            },
        ) as stream,
    ):
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert message.role == "assistant"
    assert message.content == "Hello from the SDK"
    assert message.tool_calls is not None
    assert message.tool_calls[0].function.name == "lookup"
    assert orjson.loads(message.tool_calls[0].function.arguments) == {"q": "nexus"}
    assert final.choices[0].finish_reason == "tool_calls"


async def test_mid_stream_failure_raises_api_error(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        stream = await api.chat.completions.create(
            model="mock/echo",
            messages=USER,
            stream=True,
            extra_body={"mock": {"fail_after": 2}},
        )
        received = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                received.append(chunk)
    assert not isinstance(info.value, openai.APIStatusError)
    assert info.value.code == "upstream_error"
    assert "fail_after" in info.value.message
    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert text == "Hello from"


async def test_non_streaming_and_http_errors(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        completion = await api.chat.completions.create(
            model="mock/echo", messages=USER, max_tokens=2
        )
        assert completion.choices[0].message.content == "Hello from"
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and completion.usage.completion_tokens == 2

        with pytest.raises(openai.NotFoundError) as missing:
            await api.chat.completions.create(model="gpt-4o", messages=USER)
        assert missing.value.code == "model_not_found"

        with pytest.raises(openai.BadRequestError) as bad:
            await api.chat.completions.create(model="mock/echo", messages=USER, temperature=5)
        assert bad.value.param == "temperature"

        with pytest.raises(openai.InternalServerError) as upstream:
            await api.chat.completions.create(
                model="mock/echo",
                messages=USER,
                stream=True,
                extra_body={"mock": {"fail_after": 0}},
            )
        assert upstream.value.status_code == 502

        models = await api.models.list()
        assert [m.id for m in models.data] == ["mock/echo"]


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_are_refused_not_dropped(make_client: MakeClient, stream: bool) -> None:
    """Nexus's answers carry no log probabilities: asked for, they were computed upstream
    and the client got ``logprobs: null`` without a word. Now a 400 naming the field,
    before any upstream call; ``logprobs: false`` asks nothing and goes on."""
    async with FakeUpstream() as fake:
        fake.add(
            Reply.stream([openai_chunk(content="Hi"), openai_chunk(finish_reason="stop"), DONE])
        )
        config = {"providers": {"up": {"kind": "openai", "base_url": fake.url + "/v1"}}}
        async with await sdk(make_client, config) as api:
            asks: list[tuple[dict[str, Any], str]] = [
                ({"logprobs": True}, "logprobs"),
                ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
                ({"top_logprobs": 2}, "top_logprobs"),
            ]
            for asked, param in asks:
                with pytest.raises(openai.BadRequestError) as info:
                    await api.chat.completions.create(
                        model="up/m", messages=USER, stream=stream, **asked
                    )
                assert (info.value.code, info.value.param) == ("invalid_request", param)
            with pytest.raises(openai.BadRequestError) as info:
                await api.responses.create(model="up/m", input="hi", top_logprobs=2, stream=stream)
            assert (info.value.code, info.value.param) == ("invalid_request", "top_logprobs")
            assert fake.requests == []
            completion = await api.chat.completions.create(
                model="up/m", messages=USER, logprobs=False
            )
        assert completion.choices[0].message.content == "Hi"
        assert fake.requests[0].body["logprobs"] is False


async def test_a_refusal_has_null_content(make_client: MakeClient) -> None:
    """OpenAI sends ``content: null`` beside a refusal: a client that checks ``content is
    not None`` would show an empty answer."""
    frames = [
        openai_chunk(role="assistant", content=None, refusal=""),
        openai_chunk(refusal="I can't help."),
        openai_chunk(finish_reason="stop"),
        DONE,
    ]
    async with FakeUpstream(Reply.stream(frames)) as upstream:
        config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
        api = await sdk(make_client, config)
        completion = await api.chat.completions.create(model="up/m", messages=USER)  # type: ignore[arg-type]
    message = completion.choices[0].message
    assert (message.content, message.refusal) == (None, "I can't help.")
    await api.close()


class CitingProvider(Provider):
    """Text, then two citations and two images, as a search or image model sends them."""

    kind = "citing"

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        yield [Delta(content="Two sources.")]
        yield [Citation(url="https://a.test", title="A")]
        yield [Citation(url="https://b.test", title="B")]
        yield [Image(url="https://a.test/1.png")]
        yield [Image(url="https://a.test/2.png")]
        yield [Delta(finish_reason="stop")]


async def test_the_stream_helper_takes_several_citations_and_images(
    make_client: MakeClient,
) -> None:
    """Each went out as a list of one entry with no ``index``: the helper, adding the
    second to the first, raised ``Expected list delta entry to have an index key``."""
    client = await make_client(None, providers=[CitingProvider("citing")])
    url = str(client.make_url("/v1"))
    async with (
        AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as api,
        api.chat.completions.stream(model="citing/m", messages=USER) as stream,  # type: ignore[arg-type]
    ):
        final = await stream.get_final_completion()
    message = final.choices[0].message.to_dict()
    assert [a["url_citation"]["url"] for a in message["annotations"]] == [
        "https://a.test",
        "https://b.test",
    ]
    assert [i["image_url"]["url"] for i in message["images"]] == [  # type: ignore[typeddict-item]
        "https://a.test/1.png",
        "https://a.test/2.png",
    ]

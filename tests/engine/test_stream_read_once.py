"""A stream read a second time by ``accumulate`` gave an empty completion (no content,
no finish reason, no usage) as if the model had answered nothing: it raises now."""

from __future__ import annotations

import pytest

from nexus import Engine, MockProvider, accumulate

BODY = {"model": "mock/echo", "messages": [{"role": "user", "content": "a b c"}]}


async def test_accumulate_refuses_a_stream_already_read() -> None:
    async with Engine([MockProvider("mock")]) as engine:
        stream = engine.complete_stream(BODY)
        assert (await accumulate(stream)).content == "a b c"
        with pytest.raises(RuntimeError, match="already read"):
            await accumulate(stream)
        opened = await engine.open_stream(BODY)
        assert [event async for event in opened]
        with pytest.raises(RuntimeError, match="already read"):
            await accumulate(opened)


async def test_accumulate_refuses_a_closed_stream_or_channel() -> None:
    async with Engine([MockProvider("mock")]) as engine:
        stream = engine.complete_stream(BODY)
        await stream.close()
        with pytest.raises(RuntimeError, match="already read"):
            await accumulate(stream)
        channel = engine.complete_stream(BODY).channel()
        assert (await accumulate(channel)).content == "a b c"
        with pytest.raises(RuntimeError, match="already read"):
            await accumulate(channel)

"""Audio is held and estimated by its duration, as OpenAI bills it, through the gateway
with the real openai SDK against an OpenAI-kind fake upstream.

Ten minutes of 8 kbit/s MP3 are 600 KB, and billed 6,000 audio tokens (one per 100 ms):
estimated by its bytes (a token per 1,000), a budget held a tenth of that, so requests
that overshot it were admitted side by side, and a client that left before the usage was
charged a tenth of the bill. Audio output cut before its usage was charged a token per
piece, where OpenAI bills one per 50 ms of it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from openai import AsyncOpenAI, AsyncStream, RateLimitError
from openai.types.chat import ChatCompletionChunk

from audio_clips import b64, mp3
from nexus.auth import ApiKey, hash_key
from nexus.server.state import HUB
from support import MakeClient
from upstreams import (
    AUDIO_ID,
    DONE,
    FakeUpstream,
    Reply,
    openai_chunk,
    openai_usage_chunk,
)

KEY = "nx-audio-estimates-0001"
SECONDS = 600
MEMO = b64(mp3(SECONDS, 8, "2", 24000))
"""Ten minutes at 8 kbit/s (MPEG-2 layer III, 24 kHz): 600,000 bytes."""
BILLED = SECONDS * 10
"""What OpenAI bills ten minutes of a user's audio: a token per 100 ms."""
PRICES = {
    "input_usd_per_mtok": 2.5,
    "output_usd_per_mtok": 10,
    "audio_input_usd_per_mtok": 40,
    "audio_output_usd_per_mtok": 80,
}
TRANSCRIBE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "transcribe"},
            {"type": "input_audio", "input_audio": {"data": MEMO, "format": "mp3"}},
        ],
    }
]
USAGE = {
    "prompt_tokens": BILLED + 10,
    "completion_tokens": 1,
    "total_tokens": BILLED + 11,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": BILLED},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
}
BILL = (BILLED * 40 + 10 * 2.5 + 1 * 10) / 1e6
"""What the upstream bills one request: $0.24."""
FIRST = openai_chunk(role="assistant", content="ok")


async def gateway(
    make_client: MakeClient, oai: FakeUpstream, budget: float
) -> tuple[TestClient[Any, Any], AsyncOpenAI]:
    key = {"name": "tenant", "sha256": hash_key(KEY), "budget_usd": budget}
    client = await make_client(
        {
            "auth": {"keys": [{**key, "budget_period": "total"}]},
            "providers": {"oai": {"kind": "openai", "base_url": oai.url + "/v1"}},
            "models": {"oai/gpt-audio": PRICES},
        }
    )
    api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=KEY, max_retries=0)
    return client, api


async def spent(client: TestClient[Any, Any], budget: float) -> float:
    """The tenant's spend, once a stream's end has charged it (polled, 5 s at most)."""
    limits = client.app[HUB].limits
    tenant = ApiKey("tenant", budget_usd=budget, budget_period="total")
    for _ in range(500):
        if usd := await limits.spent(tenant):
            return usd
        await asyncio.sleep(0.01)
    return await limits.spent(tenant)


async def open_stream(api: AsyncOpenAI, **body: Any) -> AsyncStream[ChatCompletionChunk]:
    return await api.chat.completions.create(
        model="oai/gpt-audio",
        stream=True,
        **body,
    )


async def test_a_budget_holds_a_low_bitrate_clip_by_its_duration(
    make_client: MakeClient, oai: FakeUpstream
) -> None:
    """$0.50 holds two of them at once ($0.24 each, as billed), not four: each is held at
    its duration's tokens, so what the key spends once they end stays within its budget."""
    gate = asyncio.Event()
    answer = [FIRST, openai_chunk(finish_reason="stop"), openai_usage_chunk(USAGE), DONE]
    oai.default = Reply.stream(answer, gate=gate)
    client, api = await gateway(make_client, oai, budget=0.5)
    async with api:
        running, refused = [], []
        for _ in range(4):  # each open while the ones before it run (the upstream's gate)
            try:
                running.append(await open_stream(api, messages=TRANSCRIBE, max_tokens=16))
            except RateLimitError as error:
                refused.append(error)
        assert (len(running), len(refused)) == (2, 2)
        for error in refused:
            assert isinstance(error.body, dict)
            assert error.body["code"] == "budget_exceeded"
        gate.set()
        for stream in running:
            assert [chunk async for chunk in stream][-1].choices[0].finish_reason == "stop"
    assert len(oai.requests) == 2
    assert await spent(client, 0.5) == pytest.approx(2 * BILL)
    assert 2 * BILL <= 0.5


async def test_a_client_that_leaves_before_the_usage_is_charged_its_clip_s_duration(
    make_client: MakeClient, oai: FakeUpstream
) -> None:
    """OpenAI reports usage last: a client that leaves at the first chunk is charged the
    prompt's estimate, its ten minutes at least what the upstream bills them."""
    oai.add(Reply.stream([FIRST], end="stall"))
    client, api = await gateway(make_client, oai, budget=1.0)
    async with api:
        stream = await open_stream(api, messages=TRANSCRIBE, max_tokens=16)
        async for chunk in stream:
            if chunk.choices[0].delta.content == "ok":
                break  # the first token: the client leaves
        await stream.close()
    await oai.requests[0].wait_ended()
    # "transcribe" (3 tokens) and 4 for the message at $2.50; the clip's 6,000 tokens and
    # one for it at $40; the one token of output seen at $10.
    charged = await spent(client, 1.0)
    assert charged == pytest.approx((7 * 2.5 + (1 + BILLED) * 40 + 1 * 10) / 1e6)
    assert charged >= BILLED * 40 / 1e6


async def test_audio_output_cut_before_the_usage_is_charged_its_duration(
    make_client: MakeClient, oai: FakeUpstream
) -> None:
    """Twenty pieces of half a second of 24 kHz pcm16 (what OpenAI streams) are ten
    seconds: 200 audio tokens, one per 50 ms, not one a piece."""
    half_second = b64(bytes(24_000))
    first = {"id": AUDIO_ID, "transcript": "hello"}
    chunks = [openai_chunk(role="assistant", content=None, audio=first)]
    chunks += [openai_chunk(audio={"data": half_second}) for _ in range(20)]
    oai.add(Reply.stream(chunks, end="stall"))
    client, api = await gateway(make_client, oai, budget=1.0)
    async with api:
        stream = await open_stream(
            api,
            messages=[{"role": "user", "content": "say hello"}],
            max_tokens=2000,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
        )
        pieces = 0
        async for chunk in stream:
            audio = chunk.choices[0].delta.audio if chunk.choices else None
            pieces += audio is not None and audio.data is not None
            if pieces == 20:
                break
        await stream.close()
    await oai.requests[0].wait_ended()
    # "say hello" (3 tokens) and 4 for the message at $2.50; the transcript's 5 bytes, 2
    # tokens, at $10; ten seconds of audio, 200 tokens, at $80.
    assert await spent(client, 1.0) == pytest.approx((7 * 2.5 + 2 * 10 + 200 * 80) / 1e6)

"""Audio output through the gateway, with the real openai SDK against an OpenAI-kind fake
upstream that streams audio as OpenAI does: the client gets every piece (streamed) or
OpenAI's ``message.audio`` (not), names that audio by its id in the next turn, and the
endpoints whose formats have no place for audio refuse to ask for it."""

from __future__ import annotations

import base64
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from support import MakeClient
from upstreams import AUDIO_EXPIRES, AUDIO_ID, FakeUpstream, Reply, openai_audio_stream

USER = [{"role": "user", "content": "Say hi"}]
ASK = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}
PCM = [bytes(range(10)), bytes(range(100, 107)), bytes(range(200, 212))]  # padded pieces
TRANSCRIPT = ["Hi", " there", "!"]


def config(oai: FakeUpstream, claude: FakeUpstream) -> dict[str, Any]:
    return {
        "providers": {
            "oai": {"kind": "openai", "base_url": oai.url + "/v1"},
            "claude": {"kind": "anthropic", "base_url": claude.url},
        },
        "models": {"voice": {"targets": ["oai/gpt-audio"]}, "sonnet": {"targets": ["claude/m"]}},
    }


async def sdk(make_client: MakeClient, oai: FakeUpstream, claude: FakeUpstream) -> AsyncOpenAI:
    client = await make_client(config(oai, claude))
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


async def test_streamed_audio_reaches_the_client_piece_by_piece(
    make_client: MakeClient, oai: FakeUpstream, claude: FakeUpstream
) -> None:
    oai.add(Reply.stream(openai_audio_stream(TRANSCRIPT, PCM)))
    async with await sdk(make_client, oai, claude) as api:
        stream = await api.chat.completions.create(
            model="voice",
            messages=USER,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
            **ASK,  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
    assert oai.requests[0].body["modalities"] == ASK["modalities"]
    assert oai.requests[0].body["audio"] == ASK["audio"]
    pieces = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert [p.id for p in pieces if p.id] == [AUDIO_ID, AUDIO_ID]  # as the upstream sent it
    assert pieces[0].id == AUDIO_ID and pieces[0].transcript == "Hi"
    assert "".join(p.transcript or "" for p in pieces) == "Hi there!"
    audio = b"".join(base64.b64decode(p.data) for p in pieces if p.data)
    assert audio == b"".join(PCM)
    assert pieces[-1].expires_at == AUDIO_EXPIRES and pieces[-1].data is None
    assert chunks[-2].choices[0].finish_reason == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 9 + 3
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.audio_tokens == 9
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.audio_tokens == 0


async def test_a_non_streaming_answer_has_openais_message_audio(
    make_client: MakeClient, oai: FakeUpstream, claude: FakeUpstream
) -> None:
    oai.add(Reply.stream(openai_audio_stream(TRANSCRIPT, PCM)))
    async with await sdk(make_client, oai, claude) as api:
        answer = await api.chat.completions.create(
            model="voice",
            messages=USER,  # type: ignore[arg-type]
            **ASK,  # type: ignore[arg-type]
        )
    message = answer.choices[0].message
    assert message.content is None
    assert message.audio is not None
    assert message.audio.id == AUDIO_ID
    assert message.audio.expires_at == AUDIO_EXPIRES
    assert message.audio.transcript == "Hi there!"
    assert base64.b64decode(message.audio.data, validate=True) == b"".join(PCM)
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.audio_tokens == 9


async def test_the_next_turn_names_the_audio_by_its_id_upstream(
    make_client: MakeClient, oai: FakeUpstream, claude: FakeUpstream
) -> None:
    oai.add(Reply.stream(openai_audio_stream(["Bye"], PCM[:1])))
    turn = {"role": "assistant", "audio": {"id": AUDIO_ID}}
    async with await sdk(make_client, oai, claude) as api:
        await api.chat.completions.create(
            model="voice",
            messages=[*USER, turn, {"role": "user", "content": "Again"}],  # type: ignore[list-item]
            **ASK,  # type: ignore[arg-type]
        )
    assert oai.requests[0].body["messages"][1] == turn


async def test_a_provider_without_audio_is_not_sent_a_turn_naming_audio(
    make_client: MakeClient, oai: FakeUpstream, claude: FakeUpstream
) -> None:
    turn = {"role": "assistant", "audio": {"id": AUDIO_ID}}
    async with await sdk(make_client, oai, claude) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model="sonnet",
                messages=[*USER, turn, {"role": "user", "content": "Again"}],  # type: ignore[list-item]
            )
    assert caught.value.code == "unsupported_input"
    assert claude.requests == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"input": "Say hi", "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/responses", {"input": "Say hi", "audio": ASK["audio"]}, "audio"),
        (
            "/v1/messages",
            {"max_tokens": 64, "messages": USER, "modalities": ["text", "audio"]},
            "modalities",
        ),
        ("/v1/messages", {"max_tokens": 64, "messages": USER, "audio": ASK["audio"]}, "audio"),
    ],
)
async def test_formats_without_audio_refuse_to_ask_for_it(
    make_client: MakeClient,
    oai: FakeUpstream,
    claude: FakeUpstream,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    client = await make_client(config(oai, claude))
    response = await client.post(path, json={"model": "voice", **body})
    assert response.status == 400
    error = (await response.json())["error"]
    assert param in error["message"]
    if path == "/v1/responses":
        assert error["param"] == param
    assert oai.requests == []

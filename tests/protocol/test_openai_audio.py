"""Audio output from an OpenAI-kind upstream (``modalities: ["text", "audio"]``): each
streamed ``delta.audio`` piece becomes an :class:`Audio` event with its id and expiry, and
the pieces make the non-streaming ``message.audio`` OpenAI would have sent."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from nexus.events import Audio, Delta, Usage, content_delta
from nexus.merger import merge_events
from nexus.protocol.openai_chat import completion_body, joined_base64, message_audio
from nexus.protocol.openai_chunks import ChunkDecoder, chunk_events
from nexus.protocol.openai_request import upstream_body
from nexus.request import ChatRequest
from nexus.types import StreamMeta
from upstreams import AUDIO_EXPIRES, AUDIO_ID, openai_audio_stream

PCM = [bytes(range(10)), bytes(range(100, 107)), bytes(range(200, 212))]
"""Three pieces of 16-bit samples, two of them off a 3-byte boundary: padded in base64."""


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_streamed_audio_pieces_become_audio_events_with_id_and_expiry() -> None:
    decoder = ChunkDecoder("up")
    events = decoder.decode(b"".join(openai_audio_stream(["Hi", " there"], PCM)))
    assert decoder.done and decoder.error is None
    assert events == [
        Audio(transcript="Hi", id=AUDIO_ID),
        Audio(transcript=" there"),
        Audio(data=b64(PCM[0]), id=AUDIO_ID),
        Audio(data=b64(PCM[1])),
        Audio(data=b64(PCM[2])),
        Audio(expires_at=AUDIO_EXPIRES),
        Delta(finish_reason="stop"),
        Usage(
            17,
            11,
            28,
            cached_tokens=0,
            reasoning_tokens=0,
            prompt_audio_tokens=0,
            completion_audio_tokens=9,
            accepted_prediction_tokens=0,
            rejected_prediction_tokens=0,
            completion_text_tokens=2,
        ),
    ]


def test_the_general_reading_gives_the_same_audio_events() -> None:
    # A chunk the typed reading refuses is read field by field: the same events.
    chunks = openai_audio_stream(["Hi"], PCM[:1])
    events: list[Any] = []
    for frame in chunks[:-1]:
        chunk_events(orjson.loads(frame.removeprefix(b"data: ")), events)
    assert events == ChunkDecoder("up").decode(b"".join(chunks))


def test_a_chunk_with_text_and_audio_gives_both() -> None:
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"a","audio":{"data":"AAA="}}}]}\n\n'
    assert ChunkDecoder("up").decode(chunk) == [Delta("a"), Audio(data="AAA=")]


def test_text_chunks_still_make_the_shared_token_delta() -> None:
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
    [event] = ChunkDecoder("up").decode(chunk)
    assert event is content_delta("tok")  # the fast branch: one shared delta per token


def test_an_empty_audio_object_makes_no_event() -> None:
    chunk = b'data: {"choices":[{"index":0,"delta":{"audio":{}}}]}\n\n'
    assert ChunkDecoder("up").decode(chunk) == []


@pytest.mark.parametrize(
    ("audio", "what"),
    [
        ('{"data":7}', "audio data"),
        ('{"id":["x"]}', "audio id"),
        ('{"transcript":{}}', "audio transcript"),
        ('{"expires_at":"soon"}', "expires_at"),
        ('{"expires_at":1.5}', "expires_at"),
        ('"AAAA"', "audio"),
    ],
)
def test_audio_fields_of_another_type_end_the_stream(audio: str, what: str) -> None:
    decoder = ChunkDecoder("up")
    body = b'data: {"choices":[{"index":0,"delta":{"audio":%s}}]}\n\n' % audio.encode()
    assert decoder.decode(body) == []
    assert decoder.error is not None and decoder.error.code == "upstream_protocol_error"
    assert what in str(decoder.error)


def test_pieces_each_padded_join_as_bytes() -> None:
    pieces = [b64(raw) for raw in PCM]
    assert "=" in pieces[0]  # joined as text, the first padding would end the audio
    assert base64.b64decode(joined_base64(pieces), validate=True) == b"".join(PCM)


def test_one_base64_text_cut_anywhere_joins_as_text() -> None:
    whole = b64(b"".join(PCM))
    pieces = [whole[:5], whole[5:13], whole[13:]]
    assert joined_base64(pieces) == whole


def test_the_non_streaming_message_has_openais_audio_object() -> None:
    decoder = ChunkDecoder("up")
    events = decoder.decode(b"".join(openai_audio_stream(["Hi", " there"], PCM)))
    completion = merge_events(events, StreamMeta(id="chatcmpl-1", model="m", created=1))
    body = completion_body(completion)
    message = body["choices"][0]["message"]
    assert message["content"] is None  # the words are the transcript, as OpenAI sends them
    assert message["audio"] == {
        "id": AUDIO_ID,
        "data": b64(b"".join(PCM)),
        "expires_at": AUDIO_EXPIRES,
        "transcript": "Hi there",
    }
    assert body["usage"]["completion_tokens_details"]["audio_tokens"] == 9
    assert body["usage"]["completion_tokens"] == 11  # audio tokens counted within


def test_message_audio_without_an_id_or_expiry_has_them_null() -> None:
    assert message_audio([Audio(data="AAAA", format="pcm16")]) == {
        "id": None,
        "data": "AAAA",
        "expires_at": None,
        "transcript": "",
    }


def test_an_assistant_turn_naming_earlier_audio_reaches_the_upstream_as_sent() -> None:
    request = ChatRequest.model_validate(
        {
            "model": "m",
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "pcm16"},
            "messages": [
                {"role": "user", "content": "Say hi"},
                {"role": "assistant", "content": None, "audio": {"id": AUDIO_ID}},
                {"role": "user", "content": "Again"},
            ],
        }
    )
    body = upstream_body(request, "gpt-audio")
    assert body["messages"][1] == {"role": "assistant", "audio": {"id": AUDIO_ID}}
    assert body["modalities"] == ["text", "audio"]
    assert body["audio"] == {"voice": "alloy", "format": "pcm16"}

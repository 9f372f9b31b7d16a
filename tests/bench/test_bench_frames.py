"""The benchmark upstream's frames (bench/frames.py): the providers' wire shapes, byte-checked
here without a gateway; the smoke run (tests/bench/test_bench_smoke.py) reads them through Nexus."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.frames import POOL, TOKENS, Frames, Shape, frames
from bench.upstream import Settings, Upstream

OPENAI_KEYS = [
    "id",
    "object",
    "created",
    "model",
    "service_tier",
    "system_fingerprint",
    "choices",
]


def _stream(f: Frames, chunks: int) -> list[bytes]:
    body = b"".join([*f.opening, *(f.content(i) for i in range(chunks)), *f.closing(chunks)])
    assert body.endswith(b"\n\n")
    return body[:-2].split(b"\n\n")


def _openai(events: list[bytes]) -> list[dict[str, Any]]:
    assert events[-1] == b"data: [DONE]"
    out = []
    for event in events[:-1]:
        assert event.startswith(b"data: {") and b"\n" not in event
        out.append(json.loads(event[6:]))
    return out


@pytest.mark.parametrize("usage", [False, True])
def test_realistic_openai_chunks_carry_todays_fields_and_a_fresh_obfuscation_each(
    usage: bool,
) -> None:
    chunks = _openai(_stream(frames(Shape(include_usage=usage), 3), 40))
    role, *content, finish = chunks[:-1] if usage else chunks
    extra = ["usage", "obfuscation"] if usage else ["obfuscation"]
    for chunk in chunks:
        assert list(chunk) == OPENAI_KEYS + extra
        assert chunk["object"] == "chat.completion.chunk" and chunk["service_tier"] == "default"
        assert chunk["system_fingerprint"].startswith("fp_")
        assert 1 <= len(chunk["obfuscation"]) <= 16 and chunk["obfuscation"].isalnum()
        assert (chunk["id"], chunk["created"]) == (chunks[0]["id"], chunks[0]["created"])
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "", "refusal": None},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    texts = [json.loads(b'"' + t + b'"') for t in TOKENS]
    assert [c["choices"][0]["delta"] for c in content] == [
        {"content": texts[i % len(texts)]} for i in range(40)
    ]
    assert all(text.startswith(" ") for text in texts)  # how the load generator counts
    assert len({c["obfuscation"] for c in content}) > 30  # no two frames alike around the text
    assert finish["choices"][0]["finish_reason"] == "stop"
    if usage:
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40


def test_without_obfuscation_content_chunks_differ_by_their_text_only() -> None:
    f = frames(Shape(include_usage=True, obfuscation=False), 0)
    chunks = _openai(_stream(f, 10))
    assert all("obfuscation" not in c for c in chunks)
    assert len(f.tails) == 1 and f.content(3) == f.head + TOKENS[3] + f.tails[0]


def test_the_pool_of_obfuscated_tails_is_cycled() -> None:
    f = frames(Shape(), 5)
    assert len(f.tails) == POOL and len(set(f.tails)) > POOL // 2
    assert f.content(POOL + 7) == f.head + TOKENS[(POOL + 7) % len(TOKENS)] + f.tails[7]


def test_synthetic_frames_are_the_old_identical_chunks() -> None:
    f = frames(Shape(frames="synthetic", include_usage=True), 2)
    chunks = _openai(_stream(f, 4))
    assert all(list(c) == ["id", "object", "created", "model", "choices"] for c in chunks[:-1])
    assert list(chunks[-1]) == ["id", "object", "created", "model", "choices", "usage"]
    assert len(f.tails) == 1 and f.content(0).replace(b" alpha", b" bravo") == f.content(1)


def test_anthropic_events_in_their_wire_order_with_the_name_repeated_in_the_json() -> None:
    events = _stream(frames(Shape("anthropic"), 1), 3)
    names, payloads = [], []
    for event in events:
        name, data = event.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:].decode()
        names.append(payload["type"])
        payloads.append(payload)
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    message = payloads[0]["message"]
    assert message["content"] == [] and message["id"].startswith("msg_01")
    assert payloads[1]["content_block"] == {"type": "text", "text": ""}
    assert payloads[3]["delta"] == {"type": "text_delta", "text": " The"}
    assert payloads[-2]["delta"]["stop_reason"] == "end_turn"
    assert payloads[-2]["usage"] == {"output_tokens": 3}


def test_frames_are_seeded_per_variant() -> None:
    assert frames(Shape(), 1).tails == frames(Shape(), 1).tails
    assert frames(Shape(), 1).prefix != frames(Shape(), 2).prefix


def _dechunk(pieces: tuple[bytes, ...]) -> list[bytes]:
    out = []
    for piece in pieces:
        size, _, rest = piece.partition(b"\r\n")
        assert rest.endswith(b"\r\n") and len(rest) == int(size, 16) + 2
        out.append(rest[:-2])
    assert out[-1] == b""  # the last chunk
    return out[:-1]


def test_a_pre_encoded_body_is_the_stream_in_writes_of_batch_frames() -> None:
    upstream = Upstream()
    upstream.configure(Settings.parse({"chunks": 40, "batch": 16}))
    f = upstream.frames(Shape(include_usage=True))
    writes = _dechunk(upstream.body(f))
    every = [*f.opening, *(f.content(i) for i in range(40)), *f.closing(40)]
    assert b"".join(writes) == b"".join(every)
    assert [w.count(b"\n\n") for w in writes] == [16, 16, len(every) - 32]


def test_the_control_endpoint_refuses_what_it_does_not_know() -> None:
    assert Settings.parse({}) == Settings()
    with pytest.raises(ValueError, match="frames"):
        Settings.parse({"frames": "identical"})
    with pytest.raises(ValueError, match="obfuscation"):
        Settings.parse({"obfuscation": "sometimes"})

"""``stream_options.include_obfuscation``: random padding in Nexus's own OpenAI chunks.

OpenAI pads each chunk with an ``obfuscation`` string of random length, against
side channels that read token lengths from packet sizes. Nexus adds it to its
chunks when the client sends ``"include_obfuscation": true``, and only then.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from openai import AsyncOpenAI

from nexus.encoders.openai_sse import OpenAISSEEncoder
from nexus.events import Delta, Usage
from nexus.types import StreamMeta
from support import MakeClient

USER = [{"role": "user", "content": "one two three four five six"}]
PADDING = re.compile(r"[A-Za-z0-9_-]{1,16}")


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "mock/echo", "stream": True, "messages": USER, **extra}


def chunks(body: bytes) -> list[dict[str, Any]]:
    return [
        orjson.loads(line[6:])
        for line in body.split(b"\n")
        if line.startswith(b"data: {")  # not [DONE]
    ]


@pytest.mark.parametrize("options", [None, {}, {"include_obfuscation": False}])
async def test_no_field_unless_asked(make_client: MakeClient, options: Any) -> None:
    client = await make_client()
    extra = {} if options is None else {"stream_options": options}
    resp = await client.post("/v1/chat/completions", json=chat(**extra))
    assert resp.status == 200
    body = await resp.read()
    assert b"obfuscation" not in body
    assert len(chunks(body)) >= 7


async def test_every_chunk_is_padded_when_asked(make_client: MakeClient) -> None:
    client = await make_client()
    options = {"include_obfuscation": True, "include_usage": True}
    resp = await client.post("/v1/chat/completions", json=chat(stream_options=options))
    assert resp.status == 200
    got = chunks(await resp.read())
    assert len(got) >= 8  # role, six words, finish, usage
    for chunk in got:
        # Exactly the chunk's fields, the padding last (OpenAI's order).
        keys = ["id", "object", "created", "model", "choices"]
        keys += ["usage", "obfuscation"] if "usage" in chunk else ["obfuscation"]
        assert list(chunk) == keys
        assert PADDING.fullmatch(chunk["obfuscation"]), chunk["obfuscation"]
    assert got[-1]["choices"] == [] and got[-1]["usage"]["total_tokens"] > 0
    assert len({c["obfuscation"] for c in got}) > 1, "random per chunk"
    assert len({len(c["obfuscation"]) for c in got}) > 1, "of varying length"


def test_the_padding_is_random_base64url_of_1_to_16_characters() -> None:
    meta = StreamMeta.new("m", include_obfuscation=True, include_usage=True)
    encoder = OpenAISSEEncoder(meta)
    paddings = [orjson.loads(encoder.encode(Delta("hi"))[6:])["obfuscation"] for _ in range(2000)]
    assert all(PADDING.fullmatch(p) for p in paddings)
    assert {len(p) for p in paddings} == set(range(1, 17))
    # Random, not a few strings over again: of 16.7 million paddings of 4 characters or
    # more, ~1,600 draws repeat one 0.08 times on average (short ones repeat by design).
    long = [p for p in paddings if len(p) >= 4]
    assert len(set(long)) >= len(long) - 2
    usage = orjson.loads(encoder.encode(Usage(1, 2, 3))[6:])
    assert usage["usage"]["total_tokens"] == 3
    assert PADDING.fullmatch(usage["obfuscation"])


@pytest.mark.parametrize("value", ["true", 1, "yes", [], {}])
async def test_a_value_that_is_not_a_boolean_is_a_400(make_client: MakeClient, value: Any) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions", json=chat(stream_options={"include_obfuscation": value})
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "invalid_request"
    assert error["param"] == "stream_options.include_obfuscation"


async def test_the_openai_sdk_parses_padded_chunks(make_client: MakeClient) -> None:
    client = await make_client()
    async with AsyncOpenAI(
        base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0
    ) as api:
        stream = await api.chat.completions.create(
            model="mock/echo",
            messages=USER,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_obfuscation": True, "include_usage": True},
        )
        got = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert text == "one two three four five six"
    assert got[-1].usage is not None
    assert all(PADDING.fullmatch(getattr(c, "obfuscation", "")) for c in got)

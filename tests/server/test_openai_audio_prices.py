"""Audio prices and OpenAI's usage details through the gateway, with the real openai SDK
against an OpenAI-kind fake upstream: the details the upstream reports (audio, text and
image counts, predicted output) reach the client as sent, streamed and not, and absent
stay absent; audio tokens cost the audio prices in the spend (the access line, the
budget) and in ``usage.cost``; a key with a budget may ask a model with audio prices
for audio, and is refused it where they are missing."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.types import CompletionUsage

from audio_clips import b64, wav
from nexus.auth import hash_key
from support import MakeClient, access_record
from upstreams import FakeUpstream, Reply, openai_audio_stream, openai_chunk, openai_usage_chunk

KEY = "nx-audio-prices-0001"
ASK = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}
PCM = [bytes(range(10)), bytes(range(100, 107))]
USER = [{"role": "user", "content": "Say hi"}]

PROMPT_DETAILS = {"cached_tokens": 4, "audio_tokens": 30, "text_tokens": 10, "image_tokens": 0}
COMPLETION_DETAILS = {
    "reasoning_tokens": 0,
    "audio_tokens": 45,
    "accepted_prediction_tokens": 5,
    "rejected_prediction_tokens": 2,
    "text_tokens": 15,
}
USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 60,
    "total_tokens": 100,
    "prompt_tokens_details": PROMPT_DETAILS,
    "completion_tokens_details": COMPLETION_DETAILS,
}
PRICES = {
    "input_usd_per_mtok": 2.5,
    "output_usd_per_mtok": 10,
    "cached_input_usd_per_mtok": 1.25,
    "audio_input_usd_per_mtok": 40,
    "audio_output_usd_per_mtok": 80,
}
# 6 uncached text prompt tokens, 30 audio ones, 4 cached; 15 text completion, 45 audio.
COST = (6 * 2.5 + 30 * 40 + 4 * 1.25 + 15 * 10 + 45 * 80) / 1e6
TEXT_PRICED = (36 * 2.5 + 4 * 1.25 + 60 * 10) / 1e6  # what it cost before audio prices


def config(oai: FakeUpstream, **key: Any) -> dict[str, Any]:
    text_only = {name: PRICES[name] for name in ("input_usd_per_mtok", "output_usd_per_mtok")}
    return {
        "auth": {"keys": [{"name": "tenant", "sha256": hash_key(KEY), **key}]},
        "providers": {"oai": {"kind": "openai", "base_url": oai.url + "/v1"}},
        "models": {"oai/gpt-audio": PRICES, "oai/gpt-text": text_only},
    }


async def sdk(make_client: MakeClient, oai: FakeUpstream, **key: Any) -> AsyncOpenAI:
    client = await make_client(config(oai, **key))
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=KEY, max_retries=0)


def assert_details(usage: CompletionUsage | None) -> None:
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 60, 100)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.model_dump(exclude_unset=True) == PROMPT_DETAILS
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.model_dump(exclude_unset=True) == COMPLETION_DETAILS


async def test_streamed_usage_has_every_detail_and_audio_costs_the_audio_prices(
    make_client: MakeClient, oai: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    oai.add(Reply.stream(openai_audio_stream(["Hi"], PCM, usage=USAGE)))
    async with await sdk(make_client, oai) as api:
        stream = await api.chat.completions.create(
            model="oai/gpt-audio",
            messages=USER,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True, "include_cost": True},  # type: ignore[typeddict-unknown-key]
            **ASK,  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
    usage = chunks[-1].usage
    assert_details(usage)
    assert usage is not None and usage.model_extra is not None
    assert usage.model_extra["cost"] == pytest.approx(COST, rel=1e-9)
    line = (await access_record(caplog)).access  # type: ignore[attr-defined]
    assert (line["prompt_audio_tokens"], line["completion_audio_tokens"]) == (30, 45)
    assert line["cost_usd"] == pytest.approx(COST, rel=1e-9)
    assert line["cost_usd"] != pytest.approx(TEXT_PRICED)


async def test_a_non_streaming_answer_has_every_detail_and_the_audio_priced_cost(
    make_client: MakeClient, oai: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    oai.add(Reply.stream(openai_audio_stream(["Hi"], PCM, usage=USAGE)))
    async with await sdk(make_client, oai) as api:
        answer = await api.chat.completions.create(
            model="oai/gpt-audio",
            messages=USER,  # type: ignore[arg-type]
            **ASK,  # type: ignore[arg-type]
        )
    assert_details(answer.usage)
    line = (await access_record(caplog)).access  # type: ignore[attr-defined]
    assert line["cost_usd"] == pytest.approx(COST, rel=1e-9)


@pytest.mark.parametrize("stream", [True, False])
async def test_only_the_details_the_upstream_sent_reach_the_client(
    make_client: MakeClient, oai: FakeUpstream, stream: bool
) -> None:
    prompt = {"cached_tokens": 0, "text_tokens": 9}
    completion = {"accepted_prediction_tokens": 1}
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "total_tokens": 11,
        "prompt_tokens_details": prompt,
        "completion_tokens_details": completion,
    }
    chunks = [openai_chunk(role="assistant", content="Hi"), openai_chunk(finish_reason="stop")]
    oai.add(Reply.stream([*chunks, openai_usage_chunk(usage), b"data: [DONE]\n\n"]))
    async with await sdk(make_client, oai) as api:
        if stream:
            answer = await api.chat.completions.create(
                model="oai/gpt-text",
                messages=USER,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
            got = [chunk async for chunk in answer][-1].usage
        else:
            got = (
                await api.chat.completions.create(
                    model="oai/gpt-text",
                    messages=USER,  # type: ignore[arg-type]
                )
            ).usage
    assert got is not None and got.prompt_tokens_details is not None
    assert got.prompt_tokens_details.model_dump(exclude_unset=True) == prompt
    assert got.completion_tokens_details is not None
    assert got.completion_tokens_details.model_dump(exclude_unset=True) == completion


HALF_SECOND = {"data": b64(wav(0.5)), "format": "wav"}
AUDIO_IN = [{"role": "user", "content": [{"type": "input_audio", "input_audio": HALF_SECOND}]}]


@pytest.mark.parametrize(
    ("messages", "extra", "param", "hold"),
    [
        # 6 prompt tokens (4 a message, 2 of text) at 2.5; 10 output tokens at the audio 80.
        pytest.param(USER, ASK, "modalities", "$0.000815", id="audio-output"),
        # 4 for the message, 6 of audio (0.5 s: 5, and 1 for the clip) at 40; 10 output
        # tokens at the text 10.
        pytest.param(AUDIO_IN, {}, "messages[0]", "$0.00035", id="audio-input"),
    ],
)
async def test_a_budget_allows_audio_where_the_model_has_audio_prices(
    make_client: MakeClient,
    oai: FakeUpstream,
    caplog: pytest.LogCaptureFixture,
    messages: list[dict[str, Any]],
    extra: dict[str, Any],
    param: str,
    hold: str,
) -> None:
    """Refused by a model whose price has no audio price, as before; allowed by one whose
    price has them, held and charged at them: charged at the text prices, the spend would
    leave room for the second request."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    oai.add(Reply.stream(openai_audio_stream(["Hi"], PCM, usage=USAGE)))
    client = await make_client(config(oai, budget_usd=0.005, budget_period="total"))
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "oai/gpt-text", "messages": messages, "max_completion_tokens": 10, **extra}
    refused = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert refused.status == 403
    error = (await refused.json())["error"]
    assert (error["code"], error["param"]) == ("model_not_priced", param)
    assert oai.requests == []
    body["model"] = "oai/gpt-audio"
    allowed = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert allowed.status == 200, await allowed.text()
    assert len(oai.requests) == 1
    lines = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
    assert lines[-1]["cost_usd"] == pytest.approx(COST, rel=1e-9)
    assert TEXT_PRICED + 0.000815 < 0.005 < COST + 0.00035  # (the holds below)
    again = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert again.status == 429
    error = (await again.json())["error"]
    assert error["code"] == "budget_exceeded"
    assert f"has spent ${COST:.6g} of" in error["message"]
    assert f"may cost up to {hold} " in error["message"]
    assert len(oai.requests) == 1


async def test_a_budget_still_refuses_audio_named_by_its_id(
    make_client: MakeClient, oai: FakeUpstream
) -> None:
    """Its length is the upstream's to know, as a file's sent by id: no hold covers it."""
    client = await make_client(config(oai, budget_usd=1))
    turn = {"role": "assistant", "audio": {"id": "audio_1"}}
    body = {"model": "oai/gpt-audio", "messages": [*USER, turn, *USER]}
    resp = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert resp.status == 403
    error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("model_not_priced", "messages[1].audio")
    assert "counted by the upstream only" in error["message"]

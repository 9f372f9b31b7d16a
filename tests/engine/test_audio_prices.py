"""nexus.pricing's audio prices: audio tokens at them, text tokens at the text prices,
cached and written tokens at theirs as before; a budget's hold counts audio at them, and
a key with a budget is refused audio only where a target's price lacks them."""

from __future__ import annotations

import math
from typing import Any

import pytest

from audio_clips import b64, mp3, wav
from nexus.config import parse_config, price_table
from nexus.errors import ConfigError
from nexus.estimates import AUDIO_INPUT_TOKENS_PER_S, prompt_audio_estimate, prompt_estimate
from nexus.events import Audio, Delta, StreamEvent, Usage
from nexus.pricing import (
    Price,
    PriceTable,
    Spend,
    cost_usd,
    spend_of,
    tally,
    unpriced,
    worst_cost,
)
from nexus.protocol.audio_duration import FLOOR_BYTES_PER_S, audio_seconds
from nexus.request import ChatRequest
from nexus.types import StreamMeta

TEXT = Price(2.5, 10.0, 1.25)
AUDIO = Price(2.5, 10.0, 1.25, audio_input_usd_per_mtok=40.0, audio_output_usd_per_mtok=80.0)


def test_audio_tokens_cost_the_audio_prices_and_text_tokens_the_text_prices() -> None:
    # 1000 prompt tokens, 300 of them audio; 500 completion tokens, 200 of them audio.
    cost = cost_usd(AUDIO, 1000, 500, 0, 0, prompt_audio_tokens=300, completion_audio_tokens=200)
    assert cost == pytest.approx((700 * 2.5 + 300 * 40 + 300 * 10 + 200 * 80) / 1e6, rel=1e-12)
    # One audio token more in place of a text one costs the difference, no more.
    more = cost_usd(AUDIO, 1000, 500, 0, 0, 301, 200)
    assert more - cost == pytest.approx((40 - 2.5) / 1e6, rel=1e-9)
    more = cost_usd(AUDIO, 1000, 500, 0, 0, 300, 201)
    assert more - cost == pytest.approx((80 - 10) / 1e6, rel=1e-9)
    # Without audio prices, audio tokens cost the text prices: what they cost before.
    assert cost_usd(TEXT, 1000, 500, 0, 0, 300, 200) == cost_usd(TEXT, 1000, 500, 0)
    half = Price(2.5, 10.0, 1.25, audio_output_usd_per_mtok=80.0)
    assert cost_usd(half, 1000, 500, 0, 0, 300, 200) == pytest.approx(
        (1000 * 2.5 + 300 * 10 + 200 * 80) / 1e6, rel=1e-12
    )


def test_cached_and_written_tokens_cost_their_prices_beside_audio() -> None:
    written = Price(3.0, 15.0, 0.3, 3.75, audio_input_usd_per_mtok=40.0)
    # 1000 = 300 read + 200 written + 500 plain, 100 of those audio.
    cost = cost_usd(written, 1000, 0, 300, 200, prompt_audio_tokens=100)
    assert cost == pytest.approx((400 * 3.0 + 100 * 40 + 300 * 0.3 + 200 * 3.75) / 1e6)
    # Audio beyond the plain tokens was read or written: at the cache's prices, as before.
    assert cost_usd(written, 1000, 0, 300, 200, 900) == pytest.approx(
        (500 * 40 + 300 * 0.3 + 200 * 3.75) / 1e6
    )
    assert cost_usd(written, 1000, 0, 1000, 0, 900) == cost_usd(written, 1000, 0, 1000, 0)


@pytest.mark.parametrize(
    ("prompt_audio", "completion_audio", "micro_usd"),
    [
        (10**30, 0, 100 * 40.0 + 50 * 10.0),  # more audio than tokens: all of them, no more
        (0, 10**30, 100 * 2.5 + 50 * 80.0),
        (-5, -5, 100 * 2.5 + 50 * 10.0),  # nonsense: text, never a refund
    ],
)
def test_audio_counts_past_their_totals_are_not_trusted(
    prompt_audio: int, completion_audio: int, micro_usd: float
) -> None:
    cost = cost_usd(AUDIO, 100, 50, 0, 0, prompt_audio, completion_audio)
    assert cost * 1e6 == pytest.approx(micro_usd)


def test_a_stream_s_audio_tokens_are_in_its_spend_at_the_audio_prices() -> None:
    usage = Usage(
        prompt_tokens=1000, completion_tokens=500, total_tokens=1500, cached_tokens=100,
        prompt_audio_tokens=300, completion_audio_tokens=200, accepted_prediction_tokens=7,
    )  # fmt: skip
    meta = StreamMeta(id="s", model="m", created=0, provider="up", upstream_model="m")
    spend = PriceTable({"up/m": AUDIO}).spend(tally([usage], complete=True), meta, complete=True)
    expected = cost_usd(AUDIO, 1000, 500, 100, 0, 300, 200)
    assert spend == Spend(1000, 500, 100, 0, expected, False, 0, 300, 200)
    assert expected == pytest.approx(
        (600 * 2.5 + 300 * 40 + 100 * 1.25 + 300 * 10 + 200 * 80) / 1e6
    )


def test_a_stream_cut_before_its_usage_is_charged_its_audio_at_the_audio_prices() -> None:
    # Two audio pieces (0.1 s of 24 kHz pcm16 each: 2 tokens each, one per 50 ms) and a
    # transcript piece came, then the stream was cut (no usage).
    events: list[StreamEvent] = [
        Audio(transcript="Hi", id="audio_1"),
        Audio(data=b64(bytes(4800))),
        Audio(data=b64(bytes(4800))),
        Delta(content="x"),
    ]
    tallied = tally(events, complete=False)
    spend = spend_of(tallied, AUDIO, complete=False, prompt_estimate=900, prompt_audio_estimate=600)
    assert spend == Spend(900, 6, 0, 0, cost_usd(AUDIO, 900, 6, 0, 0, 600, 4), True, 0, 600, 4)
    assert spend.cost_usd == pytest.approx((300 * 2.5 + 600 * 40 + 2 * 10 + 4 * 80) / 1e6)
    # Never answered: nothing, audio or not.
    untouched = spend_of(
        tally([], complete=False), AUDIO, complete=False, prompt_estimate=900,
        prompt_audio_estimate=600,
    )  # fmt: skip
    assert untouched == Spend(0, 0, 0, 0, 0.0, True)


def chat(**body: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", **body})


ASK = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
HEARD = {"type": "input_audio", "input_audio": {"data": b64(wav(12)), "format": "wav"}}
"""12 s of audio: 120 tokens, one per 100 ms, and one for the clip."""
NAMED = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "audio": {"id": "audio_1"}},
    {"role": "user", "content": "again"},
]


def test_the_prompt_s_audio_is_estimated_within_the_prompt() -> None:
    request = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 40}, HEARD]}]
    )
    assert prompt_audio_estimate(request) == 1 + 120
    assert prompt_estimate(request) == 4 + 10 + prompt_audio_estimate(request)
    assert prompt_audio_estimate(chat(messages=[{"role": "user", "content": "hi"}])) == 0


def test_a_budget_holds_audio_at_the_audio_prices() -> None:
    heard = chat(messages=[{"role": "user", "content": [HEARD]}], max_tokens=100)
    audio_tokens = prompt_audio_estimate(heard)
    text_tokens = prompt_estimate(heard) - audio_tokens
    assert worst_cost(heard, [AUDIO]) == pytest.approx(
        (text_tokens * 2.5 + audio_tokens * 40 + 100 * 10) / 1e6
    )
    spoken = chat(messages=[{"role": "user", "content": "hi"}], max_tokens=100, **ASK)
    assert worst_cost(spoken, [AUDIO]) == pytest.approx(
        (prompt_estimate(spoken) * 2.5 + 100 * 80) / 1e6
    )
    # Without audio prices (such a request is refused to a budget): the text prices.
    assert worst_cost(spoken, [TEXT]) == pytest.approx(
        (prompt_estimate(spoken) * 2.5 + 100 * 10) / 1e6
    )
    # The dearest target's.
    assert worst_cost(spoken, [TEXT, AUDIO, None]) == worst_cost(spoken, [AUDIO])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param(
            {"messages": [{"role": "user", "content": "hi"}], **ASK}, "modalities", id="output"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [HEARD]}]}, "messages[0]", id="input"
        ),
    ],
)
def test_a_budget_is_refused_audio_only_where_a_target_has_no_audio_price(
    body: dict[str, Any], param: str
) -> None:
    request = chat(**body)
    assert unpriced(request, [AUDIO]) is None
    assert unpriced(request, [AUDIO, AUDIO]) is None
    assert unpriced(request, []) is None  # an unknown model: routing refuses it
    for prices in ([TEXT], [AUDIO, TEXT], [AUDIO, None]):
        refused = unpriced(request, prices)
        assert refused is not None and refused[0] == param
    half = Price(2.5, 10.0, 1.25, audio_input_usd_per_mtok=40.0)  # input only
    assert (unpriced(request, [half]) is None) == (param != "modalities")


def test_audio_named_by_its_id_is_refused_to_a_budget_even_at_audio_prices() -> None:
    request = chat(messages=NAMED)
    refused = unpriced(request, [AUDIO])
    assert refused is not None and refused[0] == "messages[1].audio"
    assert "counted by the upstream only" in refused[1]
    refused = unpriced(request, [TEXT])
    assert refused is not None and "audio_input_usd_per_mtok" in refused[1]


PROVIDERS = {"up": {"kind": "mock"}}


def test_audio_prices_come_from_the_config() -> None:
    prices = {
        "input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10,
        "audio_input_usd_per_mtok": 40, "audio_output_usd_per_mtok": 80,
    }  # fmt: skip
    table = price_table(parse_config({"providers": PROVIDERS, "models": {"up/m": prices}}))
    assert table.prices == {"up/m": Price(2.5, 10.0, 2.5, None, 40.0, 80.0)}
    plain = {"input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10}
    table = price_table(parse_config({"providers": PROVIDERS, "models": {"up/m": plain}}))
    assert table.prices["up/m"].audio_input_usd_per_mtok is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"audio_output_usd_per_mtok": 80},
            '[models."up/m"]: prices need both input_usd_per_mtok and output_usd_per_mtok',
        ),
        (
            {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1, "audio_input_usd_per_mtok": -1},
            '[models."up/m"] audio_input_usd_per_mtok: Input should be greater than or equal to 0',
        ),
        (
            {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1, "audio_output_usd_per_mtok": 2e9},
            '[models."up/m"] audio_output_usd_per_mtok: Input should be less than or equal to '
            "1000000000",
        ),
    ],
)
def test_audio_price_config_errors_are_clear(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"providers": PROVIDERS, "models": {"up/m": entry}}, "config.toml")
    assert str(caught.value) == f"config.toml: {message}"


def test_the_engine_puts_the_prompt_s_audio_estimate_in_the_stream_s_meta() -> None:
    from nexus.engine import Engine

    engine = Engine.from_config(parse_config({"providers": PROVIDERS}))
    request = chat(model="up/echo", messages=[{"role": "user", "content": [HEARD]}])
    meta = engine.complete_stream(request).meta
    assert (meta.prompt_estimate, meta.prompt_audio_estimate) == (4 + 121, 121)


def heard(data: str, fmt: str, **extra: Any) -> ChatRequest:
    part = {"type": "input_audio", "input_audio": {"data": data, "format": fmt, **extra}}
    return chat(messages=[{"role": "user", "content": [part]}], max_tokens=16)


def test_audio_input_is_estimated_by_its_duration_whatever_its_bytes() -> None:
    """Ten minutes are 6,000 tokens (one per 100 ms, as OpenAI bills a user's audio), and
    one for the clip: as an 8 kbit/s MP3 (600 KB), a 128 kbit/s one (9.6 MB) or a WAV.
    By their bytes the first was held, and charged when cut, at a tenth of its bill."""
    clips = {
        "8 kbit/s": heard(b64(mp3(600, 8, "2", 24000)), "mp3"),
        "128 kbit/s": heard(b64(mp3(600, 128, "1", 48000)), "mp3"),
        "wav": heard(b64(wav(600, 8000, 1, 1)), "wav"),
        "data url": heard("data:audio/mpeg;base64," + b64(mp3(600, 8, "2", 24000)), "mp3"),
    }
    for name, request in clips.items():
        assert prompt_audio_estimate(request) == 1 + 6000, name
        assert prompt_estimate(request) == 4 + 1 + 6000, name
    held = worst_cost(clips["8 kbit/s"], [AUDIO])
    assert held == pytest.approx((4 * 2.5 + 6001 * 40 + 16 * 10) / 1e6)
    assert held > 0.24  # what OpenAI bills 6,000 audio tokens at $40 per million


def test_audio_that_does_not_parse_is_estimated_at_the_lowest_bitrate() -> None:
    """Never under what it could run: bytes that are not frames of a known format count
    as 8 kbit/s audio (no MP3 frame runs longer than its bytes at that rate)."""
    noise = bytes(b for b in range(256) if b != 0xFF) * 4000  # 1,020,000 bytes
    floor = len(noise) / FLOOR_BYTES_PER_S * AUDIO_INPUT_TOKENS_PER_S
    for fmt in ("mp3", "wav", "ogg"):
        assert prompt_audio_estimate(heard(b64(noise), fmt)) == 1 + math.ceil(floor), fmt
    assert floor > 10_000  # a thousand bytes a second: ten seconds a kilobyte
    bad = heard("Q" * 10_001, "mp3")  # not base64: its bytes, at the floor
    assert prompt_audio_estimate(bad) == 1 + math.ceil(7500.75 / FLOOR_BYTES_PER_S * 10)
    # Raw samples (the realtime endpoint's) at their rate; a made-up rate at the floor.
    assert prompt_audio_estimate(heard(b64(bytes(96_000)), "pcm16", sample_rate=16000)) == 31
    lying = heard(b64(bytes(96_000)), "pcm16", sample_rate=10**9)
    assert prompt_audio_estimate(lying) == 1 + math.ceil(96_000 / FLOOR_BYTES_PER_S * 10)


def test_a_request_s_audio_is_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its hold and its stream's meta (the outer stream's, then the routed one's) each
    estimate the prompt: a clip is decoded and walked once, not at each."""
    from nexus import estimates
    from nexus.engine import Engine

    measured = []

    def counted(data: bytes, fmt: str, rate: object = None) -> float:
        measured.append(len(data))
        return audio_seconds(data, fmt, rate)

    monkeypatch.setattr(estimates, "audio_seconds", counted)
    engine = Engine.from_config(parse_config({"providers": PROVIDERS}))
    part = {"type": "input_audio", "input_audio": {"data": b64(wav(3)), "format": "wav"}}
    request = chat(model="up/echo", messages=[{"role": "user", "content": [part]}])
    assert engine.hold_usd(request) == 0.0  # (no price)
    assert engine.complete_stream(request).meta.prompt_audio_estimate == 31
    assert prompt_estimate(request) == 4 + 31
    assert measured == [len(wav(3))]


def test_audio_output_cut_before_its_usage_counts_by_its_duration() -> None:
    """OpenAI streams audio output as 24 kHz pcm16 and bills a token per 50 ms of it:
    twenty pieces of half a second are 200 audio tokens, not 20."""
    half_second = b64(bytes(24_000))
    events: list[StreamEvent] = [Audio(transcript="Hello there", id="audio_1")]
    events += [Audio(data=half_second) for _ in range(20)]
    tallied = tally(events, complete=False)
    # The transcript's 11 bytes are 3 text tokens (a token per 4 bytes, as a prompt's).
    assert (tallied.produced, tallied.spoken) == (3 + 200, 200)
    spend = spend_of(tallied, AUDIO, complete=False, prompt_estimate=10, prompt_audio_estimate=0)
    assert spend.cost_usd == pytest.approx((10 * 2.5 + 3 * 10 + 200 * 80) / 1e6)
    # Pieces of any size add up before rounding: 100 pieces of 10 ms are 20 tokens.
    tiny = tally([Audio(data=b64(bytes(480))) for _ in range(100)], complete=False)
    assert (tiny.produced, tiny.spoken) == (20, 20)

"""nexus.pricing: prices from the config, cost from usage (exact), spends of failed streams."""

from __future__ import annotations

import math
from dataclasses import replace

import orjson
import pytest

from audio_clips import b64, wav
from nexus.config import parse_config, price_table
from nexus.errors import ConfigError
from nexus.estimates import PDF_PAGE_TOKENS, UNSAID_PAGES, prompt_estimate
from nexus.events import Audio, Delta, Done, Error, Reasoning, StreamEvent, ToolCall, Usage
from nexus.pricing import (
    NOTHING,
    Price,
    PriceTable,
    Spend,
    Tally,
    cost_usd,
    spend_of,
    tally,
    terminal_ok,
    unpriced,
)
from nexus.request import ChatRequest
from nexus.types import StreamMeta

PRICE = Price(input_usd_per_mtok=2.5, output_usd_per_mtok=10.0, cached_input_usd_per_mtok=1.25)


def test_cost_is_uncached_input_cached_input_and_output_per_million() -> None:
    # 1000 prompt tokens of which 400 cached, 500 completion (reasoning included).
    cost = cost_usd(PRICE, prompt_tokens=1000, completion_tokens=500, cached_tokens=400)
    assert cost == (600 * 2.5 + 400 * 1.25 + 500 * 10.0) / 1_000_000
    assert cost == pytest.approx(0.007, abs=1e-15)


@pytest.mark.parametrize(
    ("prompt", "completion", "cached", "micro_usd"),
    [
        (0, 0, 0, 0.0),
        (1, 0, 0, 2.5),
        (0, 1, 0, 10.0),
        (1, 0, 1, 1.25),
        (1_000_000, 1_000_000, 0, 12_500_000.0),
        (10, 0, 50, 12.5),  # more cached than prompt: not trusted, priced as cached prompt
        (-5, -5, -5, 0.0),  # nonsense from upstream costs nothing, never a refund
    ],
)
def test_cost_exact_to_the_token(
    prompt: int, completion: int, cached: int, micro_usd: float
) -> None:
    assert cost_usd(PRICE, prompt, completion, cached) * 1_000_000 == pytest.approx(micro_usd)


def test_one_token_more_costs_exactly_one_token_more() -> None:
    base = cost_usd(PRICE, 1234, 567, 89)
    assert cost_usd(PRICE, 1235, 567, 89) - base == pytest.approx(2.5e-6, rel=1e-9)
    assert cost_usd(PRICE, 1234, 568, 89) - base == pytest.approx(10e-6, rel=1e-9)
    assert cost_usd(PRICE, 1234, 567, 90) - base == pytest.approx(-1.25e-6, rel=1e-9)


def test_cache_writes_cost_their_own_price_and_the_input_price_by_default() -> None:
    # Anthropic: 1000 prompt tokens = 100 uncached + 300 read from the cache + 600 written.
    written = Price(3.0, 15.0, 0.3, cache_write_usd_per_mtok=3.75)
    cost = cost_usd(written, 1000, 50, cached_tokens=300, cache_write_tokens=600)
    assert cost == pytest.approx((100 * 3.0 + 300 * 0.3 + 600 * 3.75 + 50 * 15.0) / 1e6)
    unpriced = Price(3.0, 15.0, 0.3)  # no write price: writes cost the input price
    assert cost_usd(unpriced, 1000, 50, 300, 600) == cost_usd(unpriced, 1000, 50, 300, 0)
    # Writes beyond what the prompt leaves after the reads are not trusted: plain prompt.
    assert cost_usd(written, 100, 0, 80, 500) == pytest.approx((80 * 0.3 + 20 * 3.75) / 1e6)
    assert cost_usd(written, 100, 0, 0, -7) == pytest.approx(100 * 3.0 / 1e6)


def test_a_stream_s_cache_writes_are_in_its_spend() -> None:
    usage = Usage(
        prompt_tokens=1000, completion_tokens=50, total_tokens=1050, cached_tokens=300,
        cache_write_tokens=600,
    )  # fmt: skip
    written = Price(3.0, 15.0, 0.3, cache_write_usd_per_mtok=3.75)
    spend = spend_of(tally([Delta(content="a"), usage], complete=True), written, complete=True)
    assert spend == Spend(1000, 50, 300, 0, cost_usd(written, 1000, 50, 300, 600), False, 600)


def meta(model: str = "fast", provider: str = "up", upstream: str = "m") -> StreamMeta:
    return StreamMeta(id="s1", model=model, created=0, provider=provider, upstream_model=upstream)


def test_the_served_target_s_price_comes_before_the_alias_s() -> None:
    own = Price(1.0, 2.0, 0.5)
    alias = Price(3.0, 4.0, 3.0)
    table = PriceTable({"up/m": own, "fast": alias})
    assert table.price("up/m", "fast") is own
    assert table.price("other/x", "fast") is alias
    assert table.price("other/x", "slow") is None


USAGE = Usage(
    prompt_tokens=1000, completion_tokens=500, total_tokens=1500, cached_tokens=400,
    reasoning_tokens=200,
)  # fmt: skip


def test_a_complete_stream_spends_its_final_usage_exactly() -> None:
    events: list[StreamEvent] = [Delta(content="a"), Delta(content="b"), USAGE]
    table = PriceTable({"up/m": PRICE})
    spend = table.spend(tally(events, complete=True), meta(), complete=True)
    assert spend == Spend(1000, 500, 400, 200, cost_usd(PRICE, 1000, 500, 400), False)


def test_without_a_price_the_cost_is_unknown() -> None:
    spend = PriceTable().spend(tally([USAGE], complete=True), meta(), complete=True)
    assert spend.cost_usd is None
    assert (spend.prompt_tokens, spend.estimated) == (1000, False)


def test_a_failed_stream_without_usage_counts_its_output_events() -> None:
    events: list[StreamEvent] = [
        Delta(role="assistant"),  # no output
        Delta(content="a"),
        Reasoning(text="hm"),
        ToolCall(index=0, id="c", name="f", arguments="{}"),
        Delta(content=""),  # no output
        Delta(content="b"),
        Audio(data="AAAA", id="audio_1"),
    ]
    tallied = tally(events, complete=False)
    assert (tallied.produced, tallied.spoken) == (5, 1)
    spend = spend_of(tallied, PRICE, complete=False)
    # The audio piece is an audio token: at the output price, which has no audio price.
    assert spend == Spend(0, 5, 0, 0, 5 * 10.0 / 1_000_000, True, completion_audio_tokens=1)


def test_a_cut_stream_counts_its_text_not_only_its_pieces() -> None:
    """OpenAI streams a token a piece; Anthropic's pieces (thinking above all) hold several.
    Cut before its usage, a stream is charged the larger of a token a piece and a token per
    4 UTF-8 bytes of its text, as a prompt is estimated: five pieces of 405 characters were
    charged 5 tokens, not ~500."""
    long = "word " * 81  # 405 bytes
    events: list[StreamEvent] = [Delta(content=long) for _ in range(4)] + [Reasoning(long)]
    tallied = tally(events, complete=False)
    assert tallied.produced == -(-5 * 405 // 4) == 507
    assert spend_of(tallied, PRICE, complete=False).completion_tokens == 507
    # One token a piece stays the floor: short pieces (OpenAI's) count one each.
    assert tally([Delta(content="a"), Delta(content="b")], complete=False).produced == 2
    # Tool-call arguments and refusals are text too; a multi-byte script counts its bytes.
    call = ToolCall(index=0, id="c", name="lookup", arguments='{"q": "' + "x" * 94 + '"}')
    assert tally([call], complete=False).produced == -(-(6 + len(call.arguments)) // 4) == 28
    assert tally([Delta(refusal="日本語" * 10)], complete=False).produced == -(-90 // 4)


def test_a_failed_stream_keeps_the_usage_billed_before_the_failure() -> None:
    # The upstream reported its input (as Anthropic's message_start does), then failed.
    early = Usage(prompt_tokens=300, completion_tokens=1, total_tokens=301, cached_tokens=100)
    events: list[StreamEvent] = [early, Delta(content="a"), Delta(content="b"), Delta(content="c")]
    spend = spend_of(tally(events, complete=False), PRICE, complete=False)
    assert spend == Spend(300, 3, 100, 0, cost_usd(PRICE, 300, 3, 100), True)
    # A usage that already counts all the output seen is the upstream's word: not estimated.
    final = spend_of(tally([Delta(content="a"), USAGE], complete=False), PRICE, complete=False)
    assert final == Spend(1000, 500, 400, 200, cost_usd(PRICE, 1000, 500, 400), False)


def test_a_stream_cut_before_any_usage_is_charged_its_prompt_s_estimate() -> None:
    # An OpenAI-style stream reports its usage last: cut after two tokens, it has none.
    events: list[StreamEvent] = [Delta(role="assistant"), Delta(content="a"), Delta(content="b")]
    spend = spend_of(tally(events, complete=False), PRICE, complete=False, prompt_estimate=900)
    assert spend == Spend(900, 2, 0, 0, cost_usd(PRICE, 900, 2, 0), True)
    # Through the price table, from the stream's meta.
    table = PriceTable({"up/m": PRICE})
    cut = StreamMeta(id="s", model="fast", created=0, provider="up", upstream_model="m",
                     prompt_estimate=900)  # fmt: skip
    assert table.spend(tally(events, complete=False), cut, complete=False) == spend
    # The upstream never answered (a refused request, a failed connection): nothing billed.
    assert spend_of(tally([], complete=False), PRICE, complete=False, prompt_estimate=900) == (
        Spend(0, 0, 0, 0, 0.0, True)
    )
    # It took the request (a 2xx) and the stream ended before any event: the prompt.
    taken = replace(cut, upstream_accepted=True)
    assert table.spend(tally([], complete=False), taken, complete=False) == (
        Spend(900, 0, 0, 0, cost_usd(PRICE, 900, 0, 0), True)
    )
    # A usage the upstream reported is its word: the estimate is not used.
    early = Usage(prompt_tokens=300, completion_tokens=1, total_tokens=301)
    reported = spend_of(tally([early, *events], complete=False), PRICE, complete=False,
                        prompt_estimate=900)  # fmt: skip
    assert reported.prompt_tokens == 300


def chat_request(**body: object) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", **body})


def test_a_prompt_is_estimated_at_a_token_per_four_bytes_and_four_per_message() -> None:
    one = chat_request(messages=[{"role": "user", "content": "x" * 400}])
    assert prompt_estimate(one) == 100 + 4
    # Rounded up; bytes, not characters (a CJK character is three bytes).
    assert prompt_estimate(chat_request(messages=[{"role": "user", "content": "abcde"}])) == 2 + 4
    assert prompt_estimate(chat_request(messages=[{"role": "user", "content": "日本"}])) == 2 + 4
    # Every text the model reads counts: parts, names, tool calls, tools, the schema.
    call = {"id": "c1", "type": "function", "function": {"name": "f" * 4, "arguments": "a" * 36}}
    image = {"url": "data:image/png;base64," + "A" * 9000}
    schema_format = {"name": "out", "schema": {"type": "object"}}
    rich = chat_request(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "s" * 40}]},
            {
                "role": "user",
                "name": "n" * 8,
                "content": [
                    {"type": "text", "text": "t" * 40},
                    {"type": "image_url", "image_url": image},
                ],
            },
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "r" * 40},
        ],
        tools=[
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        ],
        response_format={"type": "json_schema", "json_schema": schema_format},
    )
    tool = len("lookup") + len(b'{"type":"object"}')
    schema = len("out") + len(b'{"type":"object"}')
    texts = 40 + 8 + 40 + 4 + 36 + 40 + tool + schema
    # The image by its detail (auto: 765), whatever its size: its base64 is not text.
    assert prompt_estimate(rich) == -(-texts // 4) + 4 * 4 + 765


def test_a_long_prompt_cannot_hide_where_the_estimate_does_not_look() -> None:
    """Whatever goes upstream as text counts, however it is sent."""
    long = "L" * 400_000  # 100,000 tokens
    as_content = prompt_estimate(chat_request(messages=[{"role": "user", "content": long}]))
    assert as_content == 100_000 + 4
    refusal = chat_request(messages=[{"role": "assistant", "refusal": long}])
    assert prompt_estimate(refusal) == as_content
    # A field Nexus does not know is passed on upstream: it counts, JSON and all.
    extra = chat_request(messages=[{"role": "user", "content": "", "reasoning_content": long}])
    assert prompt_estimate(extra) == as_content + len(b'{"reasoning_content":""}') // 4
    # An inline document counts as its text (a PDF by its pages, at least: one that does not
    # tell them, as many as a provider takes); audio by its length; an image by its detail.
    document = "data:text/plain;base64," + "QUFB" * 100_000  # 300,000 bytes
    text = {"type": "file", "file": {"filename": "a.txt", "file_data": document}}
    assert prompt_estimate(chat_request(messages=[{"role": "user", "content": [text]}])) == (
        4 + 1 + 300_000 // 4
    )
    pdf = {
        "type": "file",
        "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,QUFB"},
    }
    assert prompt_estimate(chat_request(messages=[{"role": "user", "content": [pdf]}])) == (
        4 + UNSAID_PAGES * PDF_PAGE_TOKENS
    )
    by_id = {"type": "file", "file": {"file_id": "file-abc"}}  # its size is the upstream's
    assert prompt_estimate(chat_request(messages=[{"role": "user", "content": [by_id]}])) == 4 + 85
    audio = {"type": "input_audio", "input_audio": {"data": b64(wav(12)), "format": "wav"}}
    assert prompt_estimate(chat_request(messages=[{"role": "user", "content": [audio]}])) == (
        4 + 1 + 120  # 12 s: a token per 100 ms
    )
    # A Python caller's field orjson cannot write (an integer past 64 bits) still counts.
    huge = chat_request(messages=[{"role": "user", "content": "", "seed_big": 2**70}])
    assert prompt_estimate(huge) == 4 + -(-len(repr({"seed_big": 2**70})) // 4)
    low = {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}
    assert prompt_estimate(chat_request(messages=[{"role": "user", "content": [low]}])) == 4 + 85


def test_anthropic_s_response_schema_counts_as_openai_s_does() -> None:
    """``/v1/messages``' structured outputs ride as ``output_config.format``: its schema
    is read by the model as a ``response_format``'s is."""
    from nexus.protocol.anthropic_messages import parse_messages_request

    schema = {"type": "object", "description": "d" * 4000}
    user = {"role": "user", "content": "x" * 40}
    body = {"model": "m", "max_tokens": 5, "messages": [user]}
    plain = prompt_estimate(parse_messages_request(orjson.dumps(body)))
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    structured = parse_messages_request(orjson.dumps({**body, "output_config": fmt}))
    assert prompt_estimate(structured) == plain + -(-len(orjson.dumps(schema)) // 4)


def test_the_engine_puts_the_prompt_s_estimate_in_the_stream_s_meta() -> None:
    from nexus.engine import Engine

    engine = Engine.from_config(parse_config({"providers": PROVIDERS}))
    request = chat_request(model="up/echo", messages=[{"role": "user", "content": "x" * 40}])
    stream = engine.complete_stream(request)
    assert stream.meta.prompt_estimate == 10 + 4


def test_a_complete_stream_without_usage_is_estimated() -> None:
    tallied = tally([Delta(content="a"), Delta(content="b")], complete=True)
    assert spend_of(tallied, None, complete=True) == Spend(0, 2, 0, 0, None, True)


def test_tally_adds_up_one_event_at_a_time() -> None:
    tallied = Tally()
    for event in (Delta(content="x"), USAGE, Delta(content="y")):
        tallied.add(event)
    assert (tallied.usage, tallied.produced) == (USAGE, 2)


def test_terminal_ok() -> None:
    assert terminal_ok(Done())
    assert not terminal_ok(Done(aborted=True))
    assert not terminal_ok(Error(error_type="server_error", message="x", code="upstream_error"))


def test_nothing_spent() -> None:
    assert Spend(0, 0, 0, 0, 0.0, False) == NOTHING


# --- configuration -----------------------------------------------------------------------

PROVIDERS = {"up": {"kind": "mock"}, "other": {"kind": "mock"}}


def test_prices_of_aliases_and_provider_models() -> None:
    config = parse_config(
        {
            "providers": PROVIDERS,
            "models": {
                "fast": {
                    "targets": ["up/m", "other/n"],
                    "input_usd_per_mtok": 3,
                    "output_usd_per_mtok": 4.5,
                },
                "up/m": {
                    "input_usd_per_mtok": 2.5,
                    "output_usd_per_mtok": 10.0,
                    "cached_input_usd_per_mtok": 1.25,
                },
            },
        }
    )
    table = price_table(config)
    assert table.prices == {"fast": Price(3.0, 4.5, 3.0), "up/m": PRICE}


@pytest.mark.parametrize(
    ("models", "message"),
    [
        (
            {"up/m": {"targets": ["up/m"], "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 1.0}},
            "[models.\"up/m\"] targets: a '<provider>/<model>' entry holds prices only; "
            "an alias name has no '/'",
        ),
        (
            {"nope/m": {"input_usd_per_mtok": 1.0, "output_usd_per_mtok": 1.0}},
            "[models.\"nope/m\"]: a name with '/' must be '<provider>/<model>' with a provider "
            "among ['other', 'up']",
        ),
        (
            {"up/m": {}},
            '[models."up/m"]: set input_usd_per_mtok and output_usd_per_mtok',
        ),
        (
            {"fast": {"targets": ["up/m"], "input_usd_per_mtok": 1.0}},
            '[models."fast"]: prices need both input_usd_per_mtok and output_usd_per_mtok',
        ),
        (
            {"up/m": {"cached_input_usd_per_mtok": 1.0}},
            '[models."up/m"]: prices need both input_usd_per_mtok and output_usd_per_mtok',
        ),
        (
            {"up/m": {"cache_write_usd_per_mtok": 1.0}},
            '[models."up/m"]: prices need both input_usd_per_mtok and output_usd_per_mtok',
        ),
        (
            {
                "up/m": {
                    "input_usd_per_mtok": 1,
                    "output_usd_per_mtok": 1,
                    "cache_write_usd_per_mtok": -1,
                }
            },
            '[models."up/m"] cache_write_usd_per_mtok: Input should be greater than or equal to 0',
        ),
        (
            {"up/m": {"input_usd_per_mtok": -1.0, "output_usd_per_mtok": 1.0}},
            '[models."up/m"] input_usd_per_mtok: Input should be greater than or equal to 0',
        ),
        (
            {"up/m": {"input_usd_per_mtok": "1", "output_usd_per_mtok": 1.0}},
            '[models."up/m"] input_usd_per_mtok: Input should be a valid number',
        ),
        (
            {"up/m": {"input_usd_per_mtok": float("inf"), "output_usd_per_mtok": 1.0}},
            '[models."up/m"] input_usd_per_mtok: Input should be a finite number',
        ),
    ],
)
def test_price_config_errors_are_clear(models: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"providers": PROVIDERS, "models": models}, "config.toml")
    assert str(caught.value) == f"config.toml: {message}"


def test_a_price_entry_is_not_an_alias() -> None:
    from nexus.engine import Engine

    prices = {"input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}
    config = parse_config({"providers": PROVIDERS, "models": {"up/m": prices}})
    engine = Engine.from_config(config)
    assert engine.aliases == {}
    assert engine.prices.prices == {"up/m": Price(1.0, 2.0, 1.0)}


def test_a_cache_write_price_comes_from_the_config() -> None:
    prices = {"input_usd_per_mtok": 3.0, "output_usd_per_mtok": 15.0,
              "cache_write_usd_per_mtok": 3.75}  # fmt: skip
    table = price_table(parse_config({"providers": PROVIDERS, "models": {"up/m": prices}}))
    assert table.prices == {"up/m": Price(3.0, 15.0, 3.0, 3.75)}


@pytest.mark.parametrize("tokens", [10**30, 10**400, -(10**30)])
def test_cost_usd_is_finite_whatever_the_counts(tokens: int) -> None:
    """A count past float range made cost_usd inf (a key's budget spent forever) or
    raise OverflowError."""
    dear = Price(1_000_000.0, 1_000_000.0, 1_000_000.0, 1_000_000.0)
    cost = cost_usd(dear, tokens, tokens, tokens, tokens)
    assert math.isfinite(cost)
    assert cost <= 4 * 10**9


@pytest.mark.parametrize("usd", [math.inf, math.nan, -1.0, 1e300])
def test_a_price_is_finite_and_bounded(usd: float) -> None:
    with pytest.raises(ValueError, match="a price must be"):
        Price(usd, 1.0, 1.0)


def test_inference_held_to_one_region_is_refused_to_a_budget() -> None:
    """Anthropic bills US-only inference (``inference_geo``) above the listed price: a
    key with a budget could not be held nor charged right for it."""
    price = Price(3.0, 15.0, 0.3)
    user = [{"role": "user", "content": "hi"}]
    assert unpriced(chat_request(messages=user), [price]) is None
    refused = unpriced(chat_request(messages=user, inference_geo="us"), [price])
    assert refused is not None and refused[0] == "inference_geo"


def test_a_failed_attempts_audio_is_priced_as_audio() -> None:
    """The prompt's audio of an attempt that failed was priced as text: its cost in the
    access line and the metrics about twelve times too low."""
    from nexus.types import FailedAttempt

    voiced = Price(2.5, 10.0, 1.25, audio_input_usd_per_mtok=40.0)
    table = PriceTable({"up/m": voiced})
    meta = StreamMeta(
        id="chatcmpl-x",
        model="up/m",
        created=1,
        prompt_estimate=28,
        prompt_audio_estimate=21,
        failed_attempts=(FailedAttempt("up/m"),),
    )
    failed = table.failed(meta)
    assert (failed.prompt_tokens, failed.cost_usd) == (28, pytest.approx((7 * 2.5 + 21 * 40) / 1e6))


def test_anthropic_s_prompt_of_many_counts_is_priced_whole() -> None:
    """Input, cache reads and writes of a billion each: the prompt (three billion) was cut
    to one before its parts were priced, the writes and plain input left out."""
    anthropic = Price(3.0, 15.0, 0.30, 3.75)
    billion = 10**9
    cost = cost_usd(anthropic, 3 * billion, billion, billion, billion)
    assert cost == pytest.approx(billion * (3.0 + 0.30 + 3.75 + 15.0) / 1e6)

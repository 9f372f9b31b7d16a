"""An integrator builds the built-in providers and a price table from ``nexus`` names alone,
by keyword, as docs/python-api.md shows."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nexus import (
    AnthropicProvider,
    AnthropicProviderConfig,
    CallContext,
    Completion,
    Engine,
    Hooks,
    OpenAIProvider,
    OpenAIProviderConfig,
    Price,
    PriceTable,
    Spend,
)
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk

KEY = "sk-integrator-0123456789"


class SpendLog:
    def __init__(self) -> None:
        self.spends: list[Spend | None] = []

    async def on_stream_completed(
        self,
        ctx: CallContext,
        request_id: str,
        model: str,
        provider: str,
        elapsed: float,
        final: Completion,
        spend: Spend | None = None,
    ) -> None:
        self.spends.append(spend)


async def test_an_openai_provider_and_prices_from_nexus_names() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    frames = [openai_chunk(content="Hi"), openai_chunk(finish_reason="stop")]
    async with FakeUpstream() as fake:
        fake.add(Reply.stream([*frames, openai_usage_chunk(usage), DONE]))
        config = OpenAIProviderConfig(
            base_url=fake.url + "/v1", token_limit_field="max_completion_tokens"
        )
        prices = PriceTable(
            {
                "up/gpt-x": Price(
                    input_usd_per_mtok=1.0, output_usd_per_mtok=2.0, cached_input_usd_per_mtok=0.5
                )
            }
        )
        log = SpendLog()
        hooks = Hooks()
        hooks.add(log)
        engine = Engine([OpenAIProvider("up", config, api_key=KEY)], hooks=hooks, prices=prices)
        request = {
            "model": "up/gpt-x",
            "max_tokens": 7,
            "messages": [{"role": "user", "content": "x"}],
        }
        async with engine:
            completion = await engine.complete(request)
        seen = fake.requests[0]
    assert completion.content == "Hi"
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["Authorization"] == f"Bearer {KEY}"
    assert seen.body["max_completion_tokens"] == 7
    assert config.kind == "openai"
    [spend] = log.spends
    assert spend is not None
    assert (spend.prompt_tokens, spend.completion_tokens, spend.estimated) == (10, 5, False)
    assert spend.cost_usd == pytest.approx((10 * 1.0 + 5 * 2.0) / 1e6)


def test_an_anthropic_provider_from_nexus_names() -> None:
    config = AnthropicProviderConfig(default_max_tokens=77)
    provider = AnthropicProvider("claude", config)
    assert (config.kind, provider.base_url, provider.default_output_cap) == (
        "anthropic",
        "https://api.anthropic.com",
        77,
    )


def test_a_provider_config_validates_its_keywords() -> None:
    with pytest.raises(ValidationError, match="base_url"):
        OpenAIProviderConfig(base_url="not a url")
    with pytest.raises(ValidationError, match="no_such_key"):
        AnthropicProviderConfig(no_such_key=1)


def test_a_price_refuses_what_it_cannot_be() -> None:
    with pytest.raises(ValueError, match="a price must be from 0"):
        Price(input_usd_per_mtok=-1.0, output_usd_per_mtok=1.0, cached_input_usd_per_mtok=1.0)

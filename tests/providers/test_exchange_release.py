"""An upstream exchange's connection is closed or back in the pool on every way out: a
cancellation while the body's rest is drained after the decoder's end too."""

from __future__ import annotations

import asyncio

from nexus.config import parse_config
from nexus.providers import build_provider
from nexus.providers.http import HTTPProvider
from nexus.request import ChatRequest
from upstreams import DONE, FakeUpstream, Reply, openai_chunk


async def test_a_cancelled_drain_still_drops_the_connection() -> None:
    async with FakeUpstream() as fake:
        # [DONE], then a body that never ends: the exchange drains it for a moment.
        fake.add(Reply.stream([openai_chunk(content="ok"), DONE], end="stall"))
        config = parse_config({"providers": {"up": {"kind": "openai", "base_url": fake.url}}})
        provider = build_provider("up", config.providers["up"])
        assert isinstance(provider, HTTPProvider)
        await provider.start()
        try:
            request = ChatRequest.model_validate(
                {"model": "up/m", "messages": [{"role": "user", "content": "Hi"}]}
            )
            batches = provider.batches(request, "m")

            async def read() -> None:
                async for _ in batches:
                    pass

            task = asyncio.create_task(read())
            while not fake.requests or fake.requests[0].chunks_sent != 2:
                await asyncio.sleep(0.001)
            for _ in range(20):  # the read of [DONE]; then the drain waits
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await batches.aclose()
            await fake.requests[0].wait_ended(5.0)  # the upstream saw the connection go
        finally:
            await provider.close()

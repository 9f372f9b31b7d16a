"""The web console (``web/``) in real headless Chromium against the running gateway.

The page is served by the gateway at ``/``; the mock provider streams a
scripted text, word by word, slowly enough to cut or abort mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

import browser
from nexus.auth import hash_key
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.providers.mock import words
from nexus.server.app import create_app
from nexus.server.state import RUNTIME

browser.require()

from playwright.async_api import Browser, ConsoleMessage, Page, expect  # noqa: E402

TRANSPORTS = ["sse", "ndjson", "ws"]
TEXT = " ".join(f"token{i:02d}" for i in range(40))  # 40 deltas
_MS = re.compile(r"^\d+ ms$")
_NUMBER = re.compile(r"^\d+(\.\d+)?$")
_AT_LEAST_3 = re.compile(r"^([3-9]|\d\d+)$")


# One browser for the module, a new context (cookies, cache) for each test; every
# fixture and test runs in the module's event loop, the browser's.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chromium() -> AsyncIterator[Browser]:
    async with browser.chromium() as launched:
        yield launched


@pytest_asyncio.fixture(loop_scope="module")
async def gateway() -> AsyncIterator[TestServer]:
    config = parse_config(
        {
            # EventSource waits retry_ms before it reconnects.
            "server": {"retry_ms": 50, "shutdown_grace_s": 0},
        }
    )
    app = create_app(config, registry=default_registry.copy())
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


@pytest_asyncio.fixture(loop_scope="module")
async def page(chromium: Browser) -> AsyncIterator[Page]:
    context = await chromium.new_context()
    context.set_default_timeout(5000)
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))

    def on_console(message: ConsoleMessage) -> None:
        # CSP violations and failed loads land here; the cut connections, and the refusals
        # the tests of refused model loads ask for, are expected.
        text = message.text
        refused = any(f"{what} 401" in text for what in ("status of", "response code:"))
        refused = refused or "status of 429" in text or "HTTP Authentication failed" in text
        if message.type == "error" and "net::ERR_" not in message.text and not refused:
            errors.append(message.text)

    page.on("console", on_console)
    yield page
    await context.close()
    assert errors == [], "the page had errors"


def port_of(server: TestServer) -> int:
    assert server.port is not None
    return server.port


async def open_console(page: Page, port: int) -> None:
    await page.goto(f"http://127.0.0.1:{port}/")
    await expect(page.locator("#model")).to_have_attribute("data-loaded", "true")


async def send(page: Page, transport: str, text: str = TEXT, delay_ms: int = 0) -> None:
    """Fill the form as a person would, with a mock script in the extra fields, and send."""
    await page.select_option("#model", "mock/echo")
    await page.select_option("#transport", transport)
    await page.fill("#prompt", "Say something slowly.")
    await page.click("#extra-box summary")
    await page.fill("#extra", json.dumps({"mock": {"content": text, "delay_ms": delay_ms}}))
    await page.click("#send")


async def output_of(page: Page) -> str:
    return await page.locator("#output").text_content() or ""


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stream_renders(gateway: TestServer, page: Page, transport: str) -> None:
    text = " ".join(f"word{i}" for i in range(12))
    await open_console(page, port_of(gateway))
    await send(page, transport, text, delay_ms=5)

    await expect(page.locator("#status")).to_have_attribute("data-state", "done")
    assert await output_of(page) == text
    count = len(words(text))
    await expect(page.locator("#tokens")).to_have_text(str(count))
    await expect(page.locator("#usage")).to_contain_text(f"{count} out")
    await expect(page.locator("#ttft")).to_have_text(_MS)
    await expect(page.locator("#tps")).to_have_text(_NUMBER)
    await expect(page.locator("#reconnects")).to_have_text("0")
    await expect(page.locator("#log .ev-delta")).to_have_count(count + 1)  # + the finish delta
    await expect(page.locator("#log .ev-done")).to_have_count(1)
    if transport != "ws":
        await expect(page.locator("#stream-id")).to_have_text(re.compile(r"^chatcmpl-\w+$"))
    await expect(page.locator("#send")).to_be_enabled()
    await expect(page.locator("#abort")).to_be_disabled()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_error_event_ends_the_stream(
    gateway: TestServer, page: Page, transport: str
) -> None:
    await open_console(page, port_of(gateway))
    await page.click("#extra-box summary")
    await page.fill(
        "#extra", json.dumps({"mock": {"content": "one two three four", "fail_after": 2}})
    )
    await page.select_option("#transport", transport)
    await page.click("#send")

    await expect(page.locator("#status")).to_have_attribute("data-state", "error")
    await expect(page.locator("#error")).to_contain_text("upstream_error")
    assert await output_of(page) == "one two"
    await expect(page.locator("#log .ev-error")).to_have_count(1)
    await expect(page.locator("#send")).to_be_enabled()


@pytest.mark.parametrize(
    ("transport", "request_prefix"),
    [("sse", b"GET /v1/streams/"), ("ndjson", b"POST /v1/chat/completions")],
)
async def test_a_dropped_stream_resumes_without_loss_or_repeats(
    gateway: TestServer, page: Page, transport: str, request_prefix: bytes
) -> None:
    proxy = browser.CuttingProxy(port_of(gateway), request_prefix, b'"type":"delta"', after=8)
    async with proxy:
        await open_console(page, proxy.port)
        await send(page, transport, TEXT, delay_ms=20)

        await asyncio.wait_for(proxy.cut.wait(), 5)
        await expect(page.locator("#status")).to_have_attribute("data-state", "done")
        assert await output_of(page) == TEXT
        count = len(words(TEXT))
        await expect(page.locator("#tokens")).to_have_text(str(count))
        await expect(page.locator("#log .ev-delta")).to_have_count(count + 1)
        reconnects = int(await page.locator("#reconnects").text_content() or "0")
        assert reconnects >= 1


async def test_a_dropped_websocket_reconnects_and_the_turn_is_marked_interrupted(
    gateway: TestServer, page: Page
) -> None:
    proxy = browser.CuttingProxy(port_of(gateway), b"GET /v1/realtime", b'"type":"delta"', after=5)
    async with proxy:
        await open_console(page, proxy.port)
        await send(page, "ws", TEXT, delay_ms=20)

        await expect(page.locator("#status")).to_have_attribute("data-state", "interrupted")
        shown = await output_of(page)
        assert TEXT.startswith(shown)
        assert len(words(shown)) == 4  # the fifth delta was cut in half
        await expect(page.locator("#socket")).to_have_text("open")
        await expect(page.locator("#reconnects")).to_have_text("1")

        # The new socket carries the next turn.
        text = "after the reconnect"
        await page.fill("#extra", json.dumps({"mock": {"content": text}}))
        await page.click("#send")
        await expect(page.locator("#status")).to_have_attribute("data-state", "done")
        assert await output_of(page) == text


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_abort_stops_the_stream(gateway: TestServer, page: Page, transport: str) -> None:
    await open_console(page, port_of(gateway))
    await send(page, transport, TEXT, delay_ms=25)
    await expect(page.locator("#tokens")).to_have_text(_AT_LEAST_3)

    await page.click("#abort")
    await expect(page.locator("#status")).to_have_attribute("data-state", "aborted")
    await expect(page.locator("#send")).to_be_enabled()
    shown = await output_of(page)
    assert TEXT.startswith(shown)
    assert len(shown) < len(TEXT)
    await asyncio.sleep(0.2)  # eight token intervals: nothing more arrives
    assert await output_of(page) == shown

    # The server stopped producing too.
    if transport == "ws":
        # It cancels the turn before it confirms the abort.
        assert not any(socket.busy for socket in gateway.app[RUNTIME].sockets)
    else:
        # The page cancelled the stream by id (DELETE): its log ends early.
        stream_id = await page.locator("#stream-id").text_content()
        url = gateway.make_url(f"/v1/streams/{stream_id}").with_query(stream_format="ndjson")
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            lines = [json.loads(line) for line in (await resp.text()).splitlines()]
        assert lines[-1]["type"] == "done"
        assert sum("content" in line.get("delta", {}) for line in lines) < len(words(TEXT))


# --- with API keys: the key on fetch, the read token on EventSource -------------------------

CONSOLE_KEY = "nx-console-0123456789abcdef"


@pytest_asyncio.fixture(loop_scope="module")
async def keyed_gateway() -> AsyncIterator[TestServer]:
    config = parse_config(
        {
            "server": {"retry_ms": 50, "shutdown_grace_s": 0},
            "auth": {"keys": [{"name": "console", "sha256": hash_key(CONSOLE_KEY)}]},
        }
    )
    app = create_app(config, registry=default_registry.copy())
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def with_key(page: Page) -> None:
    """The key as the page keeps it (typed in once, remembered in this browser)."""
    await page.context.add_init_script(
        f"localStorage.setItem('nexus.key', {json.dumps(CONSOLE_KEY)});"
    )


@pytest.mark.parametrize(
    ("transport", "request_prefix"),
    [("sse", b"GET /v1/streams/"), ("ndjson", b"POST /v1/chat/completions")],
)
async def test_a_keyed_stream_resumes_after_a_drop(
    keyed_gateway: TestServer, page: Page, transport: str, request_prefix: bytes
) -> None:
    """SSE reconnects with the stream's read token (EventSource sends no key); NDJSON
    resumes with the key."""
    await with_key(page)
    proxy = browser.CuttingProxy(port_of(keyed_gateway), request_prefix, b'"type":"delta"', after=8)
    async with proxy:
        await open_console(page, proxy.port)
        await send(page, transport, TEXT, delay_ms=20)

        await asyncio.wait_for(proxy.cut.wait(), 5)
        await expect(page.locator("#status")).to_have_attribute("data-state", "done")
        assert await output_of(page) == TEXT
        assert int(await page.locator("#reconnects").text_content() or "0") >= 1
        assert "token=" not in (await page.locator("#log").text_content() or "")


async def test_a_keyed_background_stream_is_aborted_with_the_key(
    keyed_gateway: TestServer, page: Page
) -> None:
    await with_key(page)
    await open_console(page, port_of(keyed_gateway))
    await send(page, "sse", TEXT, delay_ms=25)
    await expect(page.locator("#tokens")).to_have_text(_AT_LEAST_3)
    await page.click("#abort")
    await expect(page.locator("#status")).to_have_attribute("data-state", "aborted")
    stream_id = await page.locator("#stream-id").text_content()
    url = keyed_gateway.make_url(f"/v1/streams/{stream_id}").with_query(stream_format="ndjson")
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            assert resp.status == 401  # the id alone reads nothing
        headers = {"Authorization": f"Bearer {CONSOLE_KEY}"}
        async with session.get(url, headers=headers) as resp:
            lines = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert lines[-1]["type"] == "done"
    assert sum("content" in line.get("delta", {}) for line in lines) < len(words(TEXT))


async def test_a_key_typed_after_a_refused_model_load_loads_the_models_and_clears_the_error(
    keyed_gateway: TestServer, page: Page
) -> None:
    await page.goto(f"http://127.0.0.1:{port_of(keyed_gateway)}/")
    await expect(page.locator("#status")).to_contain_text("could not load models: HTTP 401")
    await page.fill("#api-key", CONSOLE_KEY)
    await page.locator("#api-key").dispatch_event("change")
    await expect(page.locator("#model")).to_have_attribute("data-loaded", "true")
    await expect(page.locator("#status")).to_have_text("idle")
    await send(page, "ndjson", TEXT)
    await expect(page.locator("#status")).to_have_attribute("data-state", "done")
    assert await output_of(page) == TEXT


@contextlib.asynccontextmanager
async def one_request_a_second() -> AsyncIterator[TestServer]:
    """A gateway whose one key may make a request a second (a bucket of one)."""
    config = parse_config(
        {
            "auth": {"keys": [{"name": "console", "sha256": hash_key(CONSOLE_KEY)}]},
            "limits": {"requests_per_second_per_key": 1},
        }
    )
    server = TestServer(create_app(config, registry=default_registry.copy()), host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def test_a_model_load_refused_by_the_key_rate_is_tried_again_after_retry_after(
    page: Page,
) -> None:
    """At one request a second, the page's model list may find the key's bucket empty: the
    console waits out the Retry-After and loads it, instead of leaving an empty list."""
    async with one_request_a_second() as server:
        await with_key(page)
        async with aiohttp.ClientSession() as session:  # the bucket's one token, spent
            headers = {"Authorization": f"Bearer {CONSOLE_KEY}"}
            async with session.get(server.make_url("/v1/models"), headers=headers) as resp:
                assert resp.status == 200
        await page.goto(f"http://127.0.0.1:{port_of(server)}/")
        await expect(page.locator("#status")).to_contain_text("HTTP 429")
        await expect(page.locator("#status")).to_contain_text("trying again in 1 second")
        await expect(page.locator("#model")).to_have_attribute("data-loaded", "true")
        await expect(page.locator("#status")).to_have_text("idle")


async def test_at_one_request_a_second_a_send_streams_over_event_source(page: Page) -> None:
    """The SSE transport is two requests (the background POST, then the EventSource's GET
    milliseconds later): the POST's rate token pays for the GET, so a key at one request a
    second streams instead of seeing its EventSource refused."""
    async with one_request_a_second() as server:
        await with_key(page)
        await open_console(page, port_of(server))
        await asyncio.sleep(1.1)  # the model list's token is back: the bucket holds one
        await send(page, "sse", "one user action")
        await expect(page.locator("#status")).to_have_attribute("data-state", "done")
        assert await output_of(page) == "one user action"
        await expect(page.locator("#log")).to_contain_text("EventSource")


async def test_a_new_key_reopens_the_socket_and_refusals_stop_the_retries(
    keyed_gateway: TestServer, page: Page
) -> None:
    """The socket kept the key it opened with (a turn after a key change was billed to
    the old key); and a refused handshake, which a browser cannot read, was retried every
    few seconds for as long as the tab was open."""
    await with_key(page)
    await open_console(page, port_of(keyed_gateway))
    await page.select_option("#transport", "ws")
    await expect(page.locator("#socket")).to_have_text("open")
    await page.fill("#api-key", "nx-not-a-key-of-this-gateway")
    await page.locator("#api-key").dispatch_event("change")
    refused = "the gateway refused the WebSocket (invalid_api_key)"
    await expect(page.locator("#socket")).to_contain_text(refused)
    await asyncio.sleep(1.5)
    await expect(page.locator("#socket")).to_contain_text(refused)  # no more tries


async def test_a_key_a_subprotocol_cannot_carry_is_said_so_and_never_shown(
    gateway: TestServer, page: Page
) -> None:
    await open_console(page, port_of(gateway))
    key = "nx-with/slash+plus="
    await page.fill("#api-key", key)
    await page.locator("#api-key").dispatch_event("change")
    await page.select_option("#transport", "ws")
    await expect(page.locator("#socket")).to_contain_text("cannot carry")
    assert key not in (await page.locator("body").text_content() or "")
    # Sent without the script, the form would carry no key either.
    assert (
        await page.evaluate("new FormData(document.getElementById('form')).has('api-key')") is False
    )


async def test_a_socket_reconnects_once_the_gateway_is_back(
    gateway: TestServer, page: Page
) -> None:
    """Every failed reconnect counted as a refused key: after a short outage the console
    said so and never tried again."""
    proxy = browser.CuttingProxy(port_of(gateway), b"-", b"-", after=1)
    async with proxy:
        await open_console(page, proxy.port)
        await page.select_option("#transport", "ws")
        await expect(page.locator("#socket")).to_have_text("open")
        proxy.go_down()
        await expect(page.locator("#socket")).to_contain_text("reconnecting")
        await asyncio.sleep(2)  # several tries fail meanwhile
        proxy.down = False
        await expect(page.locator("#socket")).to_have_text("open", timeout=10000)

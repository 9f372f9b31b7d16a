"""Claude Code through the gateway: what it sends beside the Messages API's core reaches an
Anthropic upstream. Every request it makes with prompt caching or thinking on carries
``context_management`` (refused: ``Unknown field``, so Claude Code failed on its first
turn) and names betas in ``anthropic-beta`` (never sent on, so a field that needs one
would be refused upstream). Betas reach the upstream as its provider's ``betas`` allow."""

from __future__ import annotations

import base64
from typing import Any

import anthropic
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import hash_key
from nexus.config import parse_config
from nexus.errors import ConfigError
from nexus.protocol.anthropic_betas import parse_betas, sent_betas
from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, anthropic_stream, openai_chunk, sse

CLEAR = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
ASKED = ["claude-code-20250219", "context-management-2025-06-27", "context-1m-2025-08-07"]
USER = [{"role": "user", "content": "hi"}]


def providers(url: str, **anthropic_table: Any) -> dict[str, Any]:
    return {
        "providers": {
            "an": {"kind": "anthropic", "base_url": url, **anthropic_table},
            "op": {"kind": "openai", "base_url": url + "/v1"},
        }
    }


async def test_context_management_and_allowed_betas_reach_an_anthropic_upstream(
    make_client: MakeClient,
) -> None:
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        url = str(client.make_url(""))
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as sdk:
            async with sdk.beta.messages.stream(
                model="an/claude",
                max_tokens=64,
                messages=USER,  # type: ignore[arg-type]
                betas=ASKED,
                context_management=CLEAR,  # type: ignore[arg-type]
            ) as stream:
                final = await stream.get_final_message()
            assert final.content[0].text == "ok"  # type: ignore[union-attr]
            seen = fake.requests[-1]
            assert seen.body["context_management"] == CLEAR
            # Claude Code's own beta and the 1M window (billed at another rate) stay home.
            assert seen.headers["anthropic-beta"] == "context-management-2025-06-27"
            await sdk.messages.create(model="an/claude", max_tokens=8, messages=USER)  # type: ignore[arg-type]
            assert "anthropic-beta" not in fake.requests[-1].headers
    # An operator who prices the 1M window allows it.
    async with FakeUpstream(default=reply) as fake:
        allowed = ["context-1m-2025-08-07", "context-management-2025-06-27"]
        client = await make_client(providers(fake.url, betas=allowed))
        sent = await client.post(
            "/v1/messages",
            json={"model": "an/claude", "max_tokens": 8, "messages": USER},
            headers={"anthropic-beta": ", ".join(ASKED)},
        )
        assert sent.status == 200
        assert fake.requests[-1].headers["anthropic-beta"] == ",".join(reversed(allowed))


def test_betas_are_read_from_every_header_and_sent_once_in_the_order_asked() -> None:
    asked = parse_betas(["claude-code-20250219, context-1m-2025-08-07", " context-1m-2025-08-07,x"])
    assert asked == ["claude-code-20250219", "context-1m-2025-08-07", "context-1m-2025-08-07", "x"]
    assert sent_betas(asked, ["x", "context-1m-2025-08-07"]) == "context-1m-2025-08-07,x"
    assert sent_betas(asked, []) is None


async def test_an_openai_target_sends_neither(make_client: MakeClient) -> None:
    reply = Reply.stream([openai_chunk(content="ok"), openai_chunk(finish_reason="stop"), DONE])
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        body = {"model": "op/m", "max_tokens": 8, "messages": USER, "context_management": CLEAR}
        sent = await client.post("/v1/messages", json=body, headers={"anthropic-beta": ASKED[1]})
        assert sent.status == 200
        seen = fake.requests[-1]
        assert "context_management" not in seen.body and "anthropic_beta" not in seen.body
        assert "anthropic-beta" not in seen.headers


@pytest.mark.parametrize("value", ["Context-1M", "a b", "x,".join("b" * 3 for _ in range(40)), "é"])
async def test_a_beta_that_is_not_a_name_is_refused_by_name(
    make_client: MakeClient, value: str
) -> None:
    client = await make_client()
    body = {"model": "mock/echo", "max_tokens": 8, "messages": USER}
    sent = await client.post("/v1/messages", json=body, headers={"anthropic-beta": value})
    assert sent.status == 400
    error = (await sent.json())["error"]
    assert error["type"] == "invalid_request_error" and "anthropic-beta" in error["message"]


def test_the_allow_list_holds_beta_names_only() -> None:
    table = {"kind": "anthropic", "base_url": "https://api.anthropic.com", "betas": ["Bad Beta"]}
    with pytest.raises(ConfigError, match="betas"):
        parse_config({"providers": {"an": table}})
    default = parse_config({"providers": {"an": {"kind": "anthropic"}}}).providers["an"]
    assert "context-management-2025-06-27" in default.betas  # type: ignore[union-attr]


TOOL = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
CLAUDE_CODE_FIELDS = {
    "type": "custom",
    "defer_loading": True,
    "input_examples": [{"path": "/etc/hosts"}],
    "eager_input_streaming": True,
    "allowed_callers": ["direct"],
    "cache_control": {"type": "ephemeral"},
}


async def test_a_tools_anthropic_fields_reach_an_anthropic_upstream_or_are_refused(
    make_client: MakeClient,
) -> None:
    """A tool's ``defer_loading``, ``input_examples``, ``eager_input_streaming`` and
    ``allowed_callers`` (Claude Code's) were dropped without a word: the upstream got the
    name, description and schema alone. A field Nexus does not know, and a server tool,
    are refused by name; a target without them refuses those that change the answer."""
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        body: dict[str, Any] = {"model": "an/claude", "max_tokens": 8, "messages": USER}
        sent = await client.post("/v1/messages", json=body | {"tools": [TOOL | CLAUDE_CODE_FIELDS]})
        assert sent.status == 200
        (tool,) = fake.requests[-1].body["tools"]
        assert tool == TOOL | {k: v for k, v in CLAUDE_CODE_FIELDS.items() if k != "type"}
        refused = {
            "tools[0].mcp_server": TOOL | {"mcp_server": "x"},
            "tools[0].type": {"type": "web_search_20250305", "name": "web_search"},
        }
        for param, bad in refused.items():
            answer = await client.post("/v1/messages", json=body | {"tools": [bad]})
            assert answer.status == 400, param
            assert param in (await answer.json())["error"]["message"]
        to_openai = body | {"model": "op/m"}
        answer = await client.post(
            "/v1/messages", json=to_openai | {"tools": [TOOL | {"input_examples": [{}]}]}
        )
        assert answer.status == 400
        assert "tools[0].input_examples" in (await answer.json())["error"]["message"]
        fake.add(
            Reply.stream([openai_chunk(content="ok"), openai_chunk(finish_reason="stop"), DONE])
        )
        eager = TOOL | {"eager_input_streaming": True}
        assert (
            await client.post("/v1/messages", json=to_openai | {"tools": [eager]})
        ).status == 200
        (sent_tool,) = fake.requests[-1].body["tools"]
        assert set(sent_tool) == {"type", "function"}


PDF = base64.b64encode(b"%PDF-1.4 a tiny document").decode()
DOCUMENT = {
    "type": "document",
    "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
    "title": "notes.pdf",
    "citations": {"enabled": True},
    "cache_control": {"type": "ephemeral"},
}


async def test_a_budget_takes_a_document_of_content_blocks_not_one_by_url(
    make_client: MakeClient,
) -> None:
    """A document of ``content`` blocks is in the request (the estimate counts them): it
    was refused to a key with a budget as "a file sent by id"; one by URL still is."""
    key = "nx-budget-documents-0123456789"
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    inline = {"type": "content", "content": [{"type": "text", "text": "the notes"}]}
    by_url = {"type": "url", "url": "https://x.test/a.pdf"}
    image = {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}
    pictured = {"type": "content", "content": [image]}  # (estimated as its JSON: refused)
    async with FakeUpstream(default=reply) as fake:
        config = providers(fake.url)
        config["auth"] = {"keys": [{"name": "k", "sha256": hash_key(key), "budget_usd": 5}]}
        config["models"] = {"an/claude": {"input_usd_per_mtok": 3, "output_usd_per_mtok": 15}}
        client = await make_client(config)
        headers = {"x-api-key": key}
        for source, status in ((inline, 200), (by_url, 403), (pictured, 403)):
            document = {"type": "document", "source": source}
            content = [document, {"type": "text", "text": "read"}]
            body = {"model": "an/claude", "max_tokens": 8}
            body["messages"] = [{"role": "user", "content": content}]
            answer = await client.post("/v1/messages", json=body, headers=headers)
            assert answer.status == status, await answer.text()


async def test_documents_reach_an_anthropic_upstream_as_sent(make_client: MakeClient) -> None:
    """A ``document`` block (Claude Code sends one for a PDF it read, in a tool result) was
    refused as "Input should be a valid string": a session that had read a PDF failed on
    every later turn."""
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    by_url = {"type": "document", "source": {"type": "url", "url": "https://x.test/a.pdf"}}
    text = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "hi"},
    }
    turns = [
        {"role": "user", "content": [DOCUMENT, by_url, text, {"type": "text", "text": "read"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [DOCUMENT]}],
        },
    ]
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        url = str(client.make_url(""))
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as sdk:
            await sdk.messages.create(model="an/claude", max_tokens=8, messages=turns)  # type: ignore[arg-type]
        sent = fake.requests[-1].body["messages"]
        assert sent[0]["content"][:3] == [DOCUMENT, by_url, text]
        assert sent[2]["content"][0]["content"] == [DOCUMENT]


async def test_an_openai_target_reads_an_inline_document_and_refuses_the_rest(
    make_client: MakeClient,
) -> None:
    reply = Reply.stream([openai_chunk(content="ok"), openai_chunk(finish_reason="stop"), DONE])
    text = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "hé"},
    }
    plain = {k: v for k, v in DOCUMENT.items() if k not in ("citations", "cache_control")}
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        body: dict[str, Any] = {"model": "op/m", "max_tokens": 8}
        content = [plain, text, {"type": "text", "text": "read"}]
        sent = await client.post(
            "/v1/messages", json=body | {"messages": [{"role": "user", "content": content}]}
        )
        assert sent.status == 200
        parts = fake.requests[-1].body["messages"][0]["content"]
        data_url = "data:application/pdf;base64," + PDF
        assert parts[:2] == [
            {"type": "file", "file": {"file_data": data_url, "filename": "notes.pdf"}},
            {"type": "text", "text": "hé"},
        ]
        by_url = {"type": "document", "source": {"type": "url", "url": "https://x.test/a.pdf"}}
        refused = {
            "messages[0].content[0].source": by_url,
            "messages[0].content[0].citations": DOCUMENT,
        }
        for param, document in refused.items():
            messages = [{"role": "user", "content": [document]}]
            answer = await client.post("/v1/messages", json=body | {"messages": messages})
            assert answer.status == 400, param
            assert (await answer.json())["error"]["message"].startswith(param)
        result = {"type": "tool_result", "tool_use_id": "t1", "content": [plain]}
        turns = [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
            },
            {"role": "user", "content": [result]},
        ]
        answer = await client.post("/v1/messages", json=body | {"messages": turns})
        assert answer.status == 400
        assert "holds a block of type 'document'" in (await answer.json())["error"]["message"]


async def test_a_tool_messages_text_parts_stay_apart_for_anthropic(make_client: MakeClient) -> None:
    """A chat tool message in parts reached Anthropic as one string, joined by spaces."""
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "5"}, {"type": "text", "text": "C"}],
        },
    ]
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        sent = await client.post(
            "/v1/chat/completions", json={"model": "an/c", "messages": messages}
        )
        assert sent.status == 200
        (result,) = fake.requests[-1].body["messages"][-1]["content"]
        assert result["content"] == [{"type": "text", "text": "5"}, {"type": "text", "text": "C"}]


async def test_what_is_not_served_under_v1_messages_answers_in_anthropics_shape(
    make_client: MakeClient,
) -> None:
    """A 404 under ``/v1/messages`` (the Message Batches API, not served) and a 405 came in
    OpenAI's error shape, which the Anthropic SDK cannot read as its own."""
    client = await make_client()
    for method, path, status, kind in (
        ("POST", "/v1/messages/batches", 404, "not_found_error"),
        ("POST", "/v1/messages/count_tokens", 400, "invalid_request_error"),
        ("GET", "/v1/messages", 405, "invalid_request_error"),
    ):
        answer = await client.request(method, path, json={})
        assert answer.status == status
        body = await answer.json()
        assert body["type"] == "error" and body["error"]["type"] == kind, body
    other = await (await client.post("/v1/nothing", json={})).json()
    assert "type" not in other and other["error"]["type"] == "invalid_request_error"


async def test_top_level_cache_control_and_inference_geo_reach_anthropic(
    make_client: MakeClient,
) -> None:
    """Both are Messages API fields of the SDK's (automatic caching of the last block; where
    the model infers), and both were refused as unknown. An OpenAI-compatible target drops
    the cache mark, a hint, and refuses the residency, which it cannot honour."""
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    asked = {"cache_control": {"type": "ephemeral"}, "inference_geo": "us"}
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        body = {"model": "an/claude", "max_tokens": 8, "messages": USER} | asked
        assert (await client.post("/v1/messages", json=body)).status == 200
        sent = fake.requests[-1].body
        assert (sent["cache_control"], sent["inference_geo"]) == ({"type": "ephemeral"}, "us")
        fake.add(
            Reply.stream([openai_chunk(content="ok"), openai_chunk(finish_reason="stop"), DONE])
        )
        to_openai = body | {"model": "op/m"}
        del to_openai["inference_geo"]
        assert (await client.post("/v1/messages", json=to_openai)).status == 200
        assert "cache_control" not in fake.requests[-1].body
        refused = await client.post("/v1/messages", json=body | {"model": "op/m"})
        assert refused.status == 400
        assert (await refused.json())["error"]["message"].startswith("inference_geo:")


async def test_an_hours_cache_writes_reach_the_client_apart(make_client: MakeClient) -> None:
    """Anthropic's ``usage.cache_creation`` (five minutes' and an hour's writes, billed
    apart) reached the client as one count."""
    frames = anthropic_stream([{"type": "text", "text": "ok"}])
    start = orjson.loads(frames[0].split(b"data: ", 1)[1])
    start["message"]["usage"].update(
        cache_creation_input_tokens=100,
        cache_creation={"ephemeral_5m_input_tokens": 40, "ephemeral_1h_input_tokens": 60},
    )
    frames[0] = sse(start, event="message_start")
    async with FakeUpstream(default=Reply.stream(frames)) as fake:
        client = await make_client(providers(fake.url))
        url = str(client.make_url(""))
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as sdk:
            made = await sdk.messages.create(model="an/claude", max_tokens=8, messages=USER)  # type: ignore[arg-type]
            async with sdk.messages.stream(
                model="an/claude", max_tokens=8, messages=USER
            ) as stream:  # type: ignore[arg-type]
                streamed = await stream.get_final_message()
    for usage in (made.usage, streamed.usage):
        assert usage.cache_creation_input_tokens == 100
        assert usage.cache_creation is not None
        assert usage.cache_creation.ephemeral_1h_input_tokens == 60
        assert usage.cache_creation.ephemeral_5m_input_tokens == 40


async def test_count_tokens_is_anthropics_count_or_nexus_estimate(make_client: MakeClient) -> None:
    """Claude Code asks ``/v1/messages/count_tokens`` before each request (what ``/context``
    shows, when it compacts); it was a 404. An Anthropic target counts exactly, and free;
    a model without one gets Nexus's estimate (what a budget holds for it)."""
    async with FakeUpstream(default=Reply.json(200, {"input_tokens": 1234})) as fake:
        client = await make_client(providers(fake.url))
        url = str(client.make_url(""))
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as sdk:
            counted = await sdk.messages.count_tokens(
                model="an/claude",
                messages=USER,  # type: ignore[arg-type]
                system="Be terse.",
                tools=[TOOL],  # type: ignore[list-item]
            )
            assert counted.input_tokens == 1234
            seen = fake.requests[-1]
            assert seen.path == "/v1/messages/count_tokens"
            assert set(seen.body) == {"model", "messages", "system", "tools"}
            assert seen.body["model"] == "claude"
            beta = await sdk.beta.messages.count_tokens(
                model="an/claude",
                messages=USER,  # type: ignore[arg-type]
                betas=["context-management-2025-06-27"],
            )
            assert beta.input_tokens == 1234
            assert fake.requests[-1].headers["anthropic-beta"] == "context-management-2025-06-27"
            asked = len(fake.requests)
            estimated = await sdk.messages.count_tokens(model="op/m", messages=USER)  # type: ignore[arg-type]
            assert 0 < estimated.input_tokens < 20 and len(fake.requests) == asked
            with pytest.raises(anthropic.NotFoundError):
                await sdk.messages.count_tokens(model="nowhere/x", messages=USER)  # type: ignore[arg-type]
        fake.add(
            Reply.json(
                400, {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
            )
        )
        refused = await client.post(
            "/v1/messages/count_tokens", json={"model": "an/claude", "messages": USER}
        )
        assert refused.status == 400
        assert (await refused.json())["type"] == "error"


async def test_count_tokens_needs_the_key_and_its_models(make_client: MakeClient) -> None:
    key = "nx-counter-0123456789abcdef0123456789"
    keys = [{"name": "c", "sha256": hash_key(key), "models": ["op/*"]}]
    async with FakeUpstream(default=Reply.json(200, {"input_tokens": 7})) as fake:
        client = await make_client(providers(fake.url) | {"auth": {"keys": keys}})
        body = {"model": "an/claude", "messages": USER}
        path = "/v1/messages/count_tokens"
        assert (await client.post(path, json=body)).status == 401
        refused = await client.post(path, json=body, headers={"x-api-key": key})
        assert refused.status == 403 and fake.requests == []
        assert (await refused.json())["error"]["type"] == "permission_error"


async def test_count_tokens_falls_back_on_a_target_that_is_down(make_client: MakeClient) -> None:
    """An alias's first Anthropic target overloaded: completions fell back, the count
    answered its 529 (and the SDK retried it, or waited out a 429's Retry-After)."""
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    async with FakeUpstream(
        Reply.json(529, overloaded), Reply.json(200, {"input_tokens": 42})
    ) as fake:
        config = providers(fake.url)
        config["providers"]["an2"] = {"kind": "anthropic", "base_url": fake.url}
        config["models"] = {"claude": {"targets": ["an/claude", "an2/claude"]}}
        client = await make_client(config)
        body = {"model": "claude", "messages": USER}
        counted = await client.post("/v1/messages/count_tokens", json=body)
        assert (await counted.json(), counted.headers["X-Nexus-Token-Count"]) == (
            {"input_tokens": 42},
            "counted",
        )
        fake.add(Reply.json(200, overloaded), Reply.json(200, {"input_tokens": 43}))
        counted = await client.post("/v1/messages/count_tokens", json=body)  # 200, an error
        assert await counted.json() == {"input_tokens": 43}
        fake.add(Reply.json(529, overloaded), Reply.json(529, overloaded))
        estimated = await client.post("/v1/messages/count_tokens", json=body)
        assert estimated.status == 200 and estimated.headers["X-Nexus-Token-Count"] == "estimated"
        assert 0 < (await estimated.json())["input_tokens"] < 20
        # Each failed attempt counted as a completion's is, under the model asked for.
        page = await (await client.get("/metrics")).text()
        families = {f.name: f for f in text_string_to_metric_families(page)}
        failed = {
            (s.labels["provider"], s.labels["code"]): s.value
            for s in families["nexus_upstream_errors"].samples
            if s.name == "nexus_upstream_errors_total"
        }
        assert failed == {("an", "upstream_error"): 3, ("an2", "upstream_error"): 1}
        requests = families["nexus_requests"].samples
        assert {s.labels["model"] for s in requests if "count_tokens" in s.labels["endpoint"]} == {
            "claude"
        }

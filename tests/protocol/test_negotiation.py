"""Stream format negotiation: a pure function, tested as a table."""

from __future__ import annotations

import pytest

from nexus.encoders.registry import EncoderRegistry, _defaults
from nexus.errors import InvalidRequest, UnsupportedStreamFormat
from nexus.protocol.negotiation import AcceptRange, parse_accept, select_format

SSE = "text/event-stream"
NATIVE = "application/vnd.nexus.events+sse"
NDJSON = "application/x-ndjson"
REGISTERED = (
    "text/event-stream (sse, openai), application/vnd.nexus.events+sse (nexus, nexus-sse), "
    "application/x-ndjson (ndjson, jsonl), "
    "application/vnd.nexus.anthropic-messages+sse (anthropic, messages), "
    "application/vnd.nexus.openai-responses+sse (responses, openai-responses)"
)


@pytest.fixture(scope="module")
def registry() -> EncoderRegistry:
    return _defaults()


CASES = [
    # (query, header, accept, default, expected)
    pytest.param(None, None, None, SSE, SSE, id="nothing-gives-default"),
    pytest.param(None, None, None, NDJSON, NDJSON, id="nothing-gives-other-default"),
    pytest.param(None, None, "", NDJSON, NDJSON, id="empty-accept-gives-default"),
    # precedence: query > header > Accept > default
    pytest.param("ndjson", "nexus", NATIVE, SSE, NDJSON, id="query-beats-header-and-accept"),
    pytest.param(None, "ndjson", f"{NATIVE}, {SSE}", SSE, NDJSON, id="header-beats-accept"),
    pytest.param(None, None, NDJSON, SSE, NDJSON, id="accept-beats-default"),
    pytest.param("sse", None, NDJSON, NDJSON, SSE, id="query-beats-accept"),
    # aliases and media types, case-insensitive, whitespace around
    pytest.param("sse", None, None, NDJSON, SSE, id="alias-sse"),
    pytest.param("openai", None, None, NDJSON, SSE, id="alias-openai"),
    pytest.param("nexus", None, None, SSE, NATIVE, id="alias-nexus"),
    pytest.param("nexus-sse", None, None, SSE, NATIVE, id="alias-nexus-sse"),
    pytest.param("ndjson", None, None, SSE, NDJSON, id="alias-ndjson"),
    pytest.param("jsonl", None, None, SSE, NDJSON, id="alias-jsonl"),
    pytest.param(SSE, None, None, NDJSON, SSE, id="media-type-sse"),
    pytest.param(NATIVE, None, None, SSE, NATIVE, id="media-type-native"),
    pytest.param(None, NDJSON, None, SSE, NDJSON, id="media-type-ndjson-header"),
    pytest.param("  NDJSON\t", None, None, SSE, NDJSON, id="alias-upper-whitespace"),
    pytest.param("Nexus-SSE", None, None, SSE, NATIVE, id="alias-mixed-case"),
    pytest.param(None, " JsonL ", None, SSE, NDJSON, id="header-alias-case-whitespace"),
    pytest.param(" Application/X-NDJSON ", None, None, SSE, NDJSON, id="media-type-case"),
    # Accept: exact types, parameters, case, whitespace
    pytest.param(None, None, SSE, NDJSON, SSE, id="accept-sse"),
    pytest.param(None, None, NATIVE, SSE, NATIVE, id="accept-native"),
    pytest.param(None, None, f"{SSE}; charset=utf-8", NDJSON, SSE, id="accept-with-params"),
    pytest.param(None, None, "APPLICATION/X-NDJSON;Q=0.9", SSE, NDJSON, id="accept-case"),
    pytest.param(None, None, f"  {NDJSON}  ;  q=0.7  ", SSE, NDJSON, id="accept-whitespace"),
    # Accept: q-values
    pytest.param(None, None, f"{NDJSON};q=0.5, {NATIVE};q=0.8", SSE, NATIVE, id="q-highest"),
    pytest.param(None, None, f"{SSE};q=0.1, {NDJSON};q=0.2", SSE, NDJSON, id="q-beats-default"),
    pytest.param(None, None, f"{NDJSON};q=0.5, {SSE};q=0.5", SSE, NDJSON, id="q-tie-first"),
    pytest.param(None, None, f"{NDJSON};q=5, {SSE}", SSE, NDJSON, id="q-above-1-is-1"),
    pytest.param(None, None, f"{NDJSON}, {SSE};q=2", SSE, NDJSON, id="q-clamped-tie-first"),
    pytest.param(None, None, f"{SSE};q=0.001, {NDJSON};q=0", SSE, SSE, id="q-small-not-zero"),
    # Accept: wildcards
    pytest.param(None, None, "*/*", SSE, SSE, id="any-gives-default"),
    pytest.param(None, None, "*/*", NDJSON, NDJSON, id="any-gives-other-default"),
    pytest.param(None, None, "text/*", NDJSON, SSE, id="text-wildcard"),
    pytest.param(None, None, "application/*", SSE, NATIVE, id="app-wildcard-registration-order"),
    pytest.param(None, None, "application/*", NDJSON, NDJSON, id="app-wildcard-default"),
    pytest.param(None, None, f"*/*;q=0.1, {NATIVE};q=0.2", SSE, NATIVE, id="specific-beats-any"),
    pytest.param(None, None, f"{SSE};q=0.1, */*", SSE, NATIVE, id="most-specific-range-rules"),
    pytest.param(
        None, None, f"application/*;q=0.5, {NDJSON};q=0.5", SSE, NDJSON, id="tie-more-specific"
    ),
    pytest.param(None, None, f"text/*;q=0.9, {NDJSON};q=0.8", NDJSON, SSE, id="wildcard-q-wins"),
    # Accept: q=0 excludes
    pytest.param(None, None, f"{NDJSON};q=0, */*", NDJSON, SSE, id="q0-excludes-default"),
    pytest.param(None, None, f"{SSE};q=0, */*;q=0.1", SSE, NATIVE, id="q0-excludes"),
    pytest.param(None, None, f"{NDJSON};q=0, application/*", SSE, NATIVE, id="q0-under-wildcard"),
    pytest.param(None, None, f"{SSE};q=0.0, text/*", NDJSON, NDJSON, id="all-excluded-default"),
    pytest.param(None, None, f"{SSE};q=-1, */*", SSE, NATIVE, id="negative-q-is-0"),
    # Accept naming nothing we stream falls back to the default (what the SDKs send)
    pytest.param(None, None, "application/json", SSE, SSE, id="json-gives-default"),
    pytest.param(None, None, "application/json", NDJSON, NDJSON, id="json-gives-other-default"),
    pytest.param(None, None, f"application/json, {SSE}", NDJSON, SSE, id="json-and-sse"),
    pytest.param(None, None, "text/html, image/*", NDJSON, NDJSON, id="nothing-matches"),
    # malformed Accept items are skipped, the rest still counts
    pytest.param(
        None, None, f"garbage, , text/, */json, /x, {NDJSON}", SSE, NDJSON, id="malformed"
    ),
    pytest.param(None, None, ";;;, ,", NDJSON, NDJSON, id="only-malformed"),
    pytest.param(None, None, f"{SSE};q=nan, {NDJSON};q=0.9", SSE, NDJSON, id="q-nan-not-best"),
]


@pytest.mark.parametrize(("query", "header", "accept", "default", "expected"), CASES)
def test_select_format(
    registry: EncoderRegistry,
    query: str | None,
    header: str | None,
    accept: str | None,
    default: str,
    expected: str,
) -> None:
    assert select_format(query, header, accept, default, registry) == expected


@pytest.mark.parametrize(
    ("query", "header", "name", "source"),
    [
        ("xml", None, "xml", "stream_format"),
        (" XML ", "ndjson", "XML", "stream_format"),
        ("", None, "", "stream_format"),
        ("*/*", None, "*/*", "stream_format"),
        (
            "text/event-stream; charset=utf-8",
            None,
            "text/event-stream; charset=utf-8",
            "stream_format",
        ),
        (None, "application/json", "application/json", "X-Nexus-Stream-Format"),
        (None, "websocket", "websocket", "X-Nexus-Stream-Format"),
    ],
)
def test_unknown_name_in_query_or_header_fails(
    registry: EncoderRegistry,
    query: str | None,
    header: str | None,
    name: str,
    source: str,
) -> None:
    with pytest.raises(UnsupportedStreamFormat) as info:
        select_format(query, header, "text/event-stream", SSE, registry)
    error = info.value
    assert isinstance(error, InvalidRequest)
    assert (error.status, error.code, error.error_type) == (
        400,
        "unsupported_stream_format",
        "invalid_request_error",
    )
    assert error.param == source
    assert error.message == (
        f"Unsupported stream format {name!r} in {source}. Registered formats: {REGISTERED}."
    )
    assert error.openai_body()["error"]["code"] == "unsupported_stream_format"


def test_unknown_header_does_not_matter_when_query_names_a_format(
    registry: EncoderRegistry,
) -> None:
    assert select_format("jsonl", "bogus", "bogus/bogus", SSE, registry) == NDJSON


def test_registered_custom_format_is_negotiable(registry: EncoderRegistry) -> None:
    from nexus.encoders import NDJSONEncoder

    class Custom(NDJSONEncoder):
        media_type = "application/x-custom"
        aliases = ("custom",)

    custom = registry.copy()
    custom.register("application/x-custom", Custom)
    assert select_format("CUSTOM", None, None, SSE, custom) == "application/x-custom"
    assert select_format(None, None, "application/x-custom", SSE, custom) == "application/x-custom"
    assert select_format(None, None, "application/*", SSE, custom) == NATIVE
    with pytest.raises(UnsupportedStreamFormat, match=r"application/x-custom \(custom\)\.$"):
        select_format("nope", None, None, SSE, custom)
    # The shared registry did not change.
    with pytest.raises(UnsupportedStreamFormat):
        select_format("custom", None, None, SSE, registry)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("", []),
        ("*/*", [AcceptRange("*", "*", 1.0, 0)]),
        (
            "text/html;level=1;q=0.5, */json, text/, , foo, TEXT/Plain;Q=2",
            [AcceptRange("text", "html", 0.5, 0), AcceptRange("text", "plain", 1.0, 5)],
        ),
        (
            " text/event-stream ; charset=utf-8 , application/*;q=0.25",
            [AcceptRange("text", "event-stream", 1.0, 0), AcceptRange("application", "*", 0.25, 1)],
        ),
        ("a/b;q=abc", [AcceptRange("a", "b", 0.0, 0)]),
        ("a/b;q=", [AcceptRange("a", "b", 0.0, 0)]),
        ("a/b;q=-3", [AcceptRange("a", "b", 0.0, 0)]),
        ("a/b;q=0.333", [AcceptRange("a", "b", 0.333, 0)]),
        ("a/b;q=0.5;q=0.7", [AcceptRange("a", "b", 0.7, 0)]),
        ("a/b;q=nan", [AcceptRange("a", "b", 0.0, 0)]),
        ("a/b;q=inf", [AcceptRange("a", "b", 0.0, 0)]),
        ("/b, a/, */b, a/b", [AcceptRange("a", "b", 1.0, 3)]),
    ],
)
def test_parse_accept(header: str, expected: list[AcceptRange]) -> None:
    assert parse_accept(header) == expected


@pytest.mark.parametrize(
    ("range_", "specificity", "matches", "misses"),
    [
        (AcceptRange("*", "*", 1.0, 0), 0, [SSE, NATIVE, NDJSON], []),
        (AcceptRange("text", "*", 1.0, 0), 1, [SSE], [NATIVE, NDJSON]),
        (AcceptRange("application", "*", 1.0, 0), 1, [NATIVE, NDJSON], [SSE]),
        (AcceptRange("application", "x-ndjson", 1.0, 0), 2, [NDJSON], [SSE, NATIVE]),
    ],
)
def test_accept_range_matching(
    range_: AcceptRange, specificity: int, matches: list[str], misses: list[str]
) -> None:
    assert range_.specificity == specificity
    assert [range_.matches(m) for m in matches] == [True] * len(matches)
    assert [range_.matches(m) for m in misses] == [False] * len(misses)


def test_only_the_first_ranges_of_a_huge_accept_are_looked_at() -> None:
    """An 8 KB header of thousands of ranges took 5 ms a request, before the key's rate
    was checked; a real one holds a handful."""
    import time

    from nexus.protocol.negotiation import MAX_ACCEPT_RANGES

    huge = ", ".join(f"application/x-{n};q=0.{n % 9}" for n in range(20_000))
    assert len(parse_accept(huge)) == MAX_ACCEPT_RANGES
    started = time.perf_counter()
    for _ in range(100):
        parse_accept(huge)
    assert time.perf_counter() - started < 0.5  # ~50 µs each; 5 ms each unbounded
    # What a client means comes first: still honoured.
    first = parse_accept("application/x-ndjson, " + huge)
    assert (first[0].type, first[0].subtype) == ("application", "x-ndjson")

"""Which pages and which Host names the gateway answers: the pure rules."""

from __future__ import annotations

import pytest

from nexus.server.origins import loopback_host, origin_allowed, split_host

LISTED = ["https://app.example"]


@pytest.mark.parametrize(
    ("origin", "scheme", "host", "allowed"),
    [
        # The request's own origin: scheme, host and port, default ports filled in.
        ("http://127.0.0.1:8080", "http", "127.0.0.1:8080", True),
        ("http://LOCALHOST:8080", "http", "localhost:8080", True),
        ("http://[::1]:8080", "http", "[::1]:8080", True),
        ("http://gw.example", "http", "gw.example:80", True),
        ("https://gw.example:443", "https", "gw.example", True),
        # Another port, scheme or host is another origin.
        ("http://127.0.0.1:8081", "http", "127.0.0.1:8080", False),
        ("https://127.0.0.1:8080", "http", "127.0.0.1:8080", False),
        ("http://localhost:8080", "http", "127.0.0.1:8080", False),
        ("http://evil.example", "http", "127.0.0.1:8080", False),
        ("http://evil.example", "http", None, False),
        # Listed ones, and nothing that merely looks like them.
        ("https://app.example", "http", "127.0.0.1:8080", True),
        ("https://app.example.evil", "http", "127.0.0.1:8080", False),
        ("null", "http", "127.0.0.1:8080", False),
        ("http://127.0.0.1:8080/path", "http", "127.0.0.1:8080", False),
        ("http://u@127.0.0.1:8080", "http", "127.0.0.1:8080", False),
        ("", "http", "127.0.0.1:8080", False),
    ],
)
def test_origin_allowed(origin: str, scheme: str, host: str | None, allowed: bool) -> None:
    assert origin_allowed(origin, LISTED, scheme=scheme, host=host) is allowed


def test_a_wildcard_takes_every_origin_but_null() -> None:
    assert origin_allowed("https://any.example", ["*"], scheme="http", host=None)
    assert not origin_allowed("null", ["*"], scheme="http", host=None)
    assert origin_allowed("null", ["null"], scheme="http", host=None)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("localhost:8080", True),
        ("LocalHost.:8080", True),
        ("app.localhost:3000", True),
        ("127.0.0.1", True),
        ("127.8.9.10:1", True),
        ("[::1]:8080", True),
        ("evil.example", False),
        ("localhost.evil.example", False),
        ("evillocalhost", False),
        ("0.0.0.0:8080", False),
        ("10.0.0.1", False),
        ("[::ffff:7f00:1]", False),
        ("2130706433", False),
        ("127.0.0.1@evil.example", False),
        ("127.0.0.1:8080/x", False),
        ("", False),
    ],
)
def test_loopback_host(host: str, loopback: bool) -> None:
    assert loopback_host(host) is loopback


def test_split_host() -> None:
    assert split_host("Example.COM:8080", "http") == ("example.com", 8080)
    assert split_host("example.com", "https") == ("example.com", 443)
    assert split_host("[::1]", "http") == ("[::1]", 80)
    assert split_host("example.com", "chrome-extension") is None
    assert split_host("a b", "http") is None

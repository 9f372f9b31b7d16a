"""Read tokens (:mod:`nexus.tokens`): what verifies, what does not, and where the secret
comes from (the environment, or the supervisor for its workers)."""

from __future__ import annotations

import pytest

from nexus.config import parse_config
from nexus.errors import ConfigError
from nexus.supervisor import shared_token_secret
from nexus.tokens import MIN_SECRET_CHARS, StreamTokens, new_secret, secret_from_env

SECRET = "s" * MIN_SECRET_CHARS
STREAM = "chatcmpl-0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000.25


def test_a_token_reads_its_stream_until_it_expires() -> None:
    tokens = StreamTokens(SECRET)
    token = tokens.issue(STREAM, NOW, 300)
    expires, _, mac = token.partition(".")
    assert int(expires) == 1_800_000_301  # now + ttl, rounded up to a second
    assert len(mac) == 43
    assert tokens.check(token, STREAM, NOW)
    assert tokens.check(token, STREAM, 1_800_000_300.99)
    assert not tokens.check(token, STREAM, 1_800_000_301)
    assert not tokens.check(token, STREAM, NOW + 10_000)


def test_a_token_is_good_for_its_stream_and_its_secret_only() -> None:
    tokens = StreamTokens(SECRET)
    token = tokens.issue(STREAM, NOW, 300)
    assert not tokens.check(token, STREAM[:-1] + "0", NOW)
    assert not tokens.check(token, STREAM + "x", NOW)
    assert not StreamTokens("t" * MIN_SECRET_CHARS).check(token, STREAM, NOW)
    # The same secret in another process (a replica, a worker) verifies it.
    assert StreamTokens(SECRET).check(token, STREAM, NOW)


def tampered(token: str) -> list[str]:
    expires, _, mac = token.partition(".")
    flipped = ("A" if mac[5] != "A" else "B").join((mac[:5], mac[6:]))
    return [
        f"{int(expires) + 1000}.{mac}",  # a later expiry
        f"0{expires}.{mac}",  # the same expiry, spelt otherwise
        f"{expires}.{flipped}",
        f"{expires}.{mac[:-1]}",
        f"{expires}.{mac}A",
        f"{expires}.{mac}=",
        f"{expires}{mac}",
        f"+{expires}.{mac}",
        f"{expires}.{mac}".replace(".", ".."),
        "\u0661" * len(expires) + "." + mac,  # Arabic-Indic digits: digits to str.isdigit
        f"{expires}.{'é' * 43}",
        "",
        ".",
        "1" * 5000 + "." + mac,
        mac,
    ]


def test_a_tampered_or_malformed_token_does_not_verify() -> None:
    tokens = StreamTokens(SECRET)
    token = tokens.issue(STREAM, NOW, 300)
    for bad in tampered(token):
        assert not tokens.check(bad, STREAM, NOW), bad


def test_an_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        StreamTokens("")


def test_the_secret_comes_from_the_environment_variable_named() -> None:
    assert secret_from_env("NEXUS_TOKEN_SECRET", {}) is None
    assert secret_from_env("NEXUS_TOKEN_SECRET", {"NEXUS_TOKEN_SECRET": "  "}) is None
    assert secret_from_env("MINE", {"MINE": f" {SECRET}\n"}) == SECRET
    with pytest.raises(ConfigError, match=r"MINE holds a secret of 8 characters.*at least 32"):
        secret_from_env("MINE", {"MINE": "password"})
    assert len(new_secret()) >= MIN_SECRET_CHARS
    assert new_secret() != new_secret()


def test_the_supervisor_hands_one_made_secret_to_its_workers() -> None:
    """Workers fork inside the block: they inherit the secret it put in the environment."""
    config = parse_config({"auth": {"token_secret_env": "MY_SECRET"}})
    environ: dict[str, str] = {"OTHER": "x"}
    with shared_token_secret(config, environ):
        made = environ["MY_SECRET"]
        assert secret_from_env("MY_SECRET", environ) == made
    assert environ == {"OTHER": "x"}  # put back as it was
    environ = {"MY_SECRET": ""}
    with shared_token_secret(config, environ):
        assert len(environ["MY_SECRET"]) >= MIN_SECRET_CHARS
    assert environ == {"MY_SECRET": ""}
    # A configured secret is left alone, and a short one stops the start.
    environ = {"MY_SECRET": SECRET}
    with shared_token_secret(config, environ):
        assert environ["MY_SECRET"] == SECRET
    with (
        pytest.raises(ConfigError, match="MY_SECRET"),
        shared_token_secret(config, {"MY_SECRET": "short"}),
    ):
        pass


def test_token_secret_env_is_an_environment_variable_name() -> None:
    assert parse_config({}).auth.token_secret_env == "NEXUS_TOKEN_SECRET"
    with pytest.raises(ConfigError, match=r"\[auth\] token_secret_env"):
        parse_config({"auth": {"token_secret_env": "not a name"}})
    with pytest.raises(ConfigError, match=r"\[auth\] token_secret_env"):
        parse_config({"auth": {"token_secret_env": ""}})


def test_a_token_names_the_key_it_was_issued_to_and_cannot_be_moved() -> None:
    """Its reads are charged to that key: another name in it does not verify."""
    tokens = StreamTokens(SECRET)
    token = tokens.issue(STREAM, NOW, 300, key="beta.team@x:1")
    assert token.endswith(".beta.team@x:1")
    grant = tokens.check(token, STREAM, NOW)
    assert grant is not None and grant.key == "beta.team@x:1"
    head = token[: -len(".beta.team@x:1")]
    for bad in (head + ".alpha", head, head + ".", head + ".beta team", token + "x" * 60):
        assert tokens.check(bad, STREAM, NOW) is None, bad
    plain = tokens.check(tokens.issue(STREAM, NOW, 300), STREAM, NOW)
    assert plain is not None and plain.key is None

"""What is said of a Redis URL's credentials: cut out where they stand as a URL's userinfo, a
``password=`` parameter or a word of their own, and nowhere else. Replaced as substrings
anywhere, a user ``u`` and a password ``PW`` made the driver's "Port could not be cast to
integer value" read "Port co***ld not be cast to integer val***e": the message garbled,
and the credential's letters told by where the ``***`` fell."""

from __future__ import annotations

import pytest

from nexus.cache.redis_url import check_url, scrub
from nexus.config import parse_config
from nexus.errors import ConfigError


@pytest.mark.parametrize(
    "message",
    [
        "Port could not be cast to integer value as 'abc'",
        "Invalid value for 'socket_timeout' in connection URL.",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "Upward PWD unused",
    ],
)
def test_a_message_without_the_credentials_is_kept_as_it_is(message: str) -> None:
    assert scrub(message, "redis://u:PW@127.0.0.1:6379/0") == message
    assert scrub(message, "redis://127.0.0.1/0?password=e") == message


@pytest.mark.parametrize(
    ("message", "url", "said"),
    [
        (
            "Error connecting to u:PW@127.0.0.1:1",
            "redis://u:PW@127.0.0.1:1/0",
            "Error connecting to ***@127.0.0.1:1",
        ),
        (
            "Error connecting to redis://:s3cret-pw@h:1/0",
            "redis://:s3cret-pw@h:1/0",
            "Error connecting to redis://***@h:1/0",
        ),
        (
            "bad URL redis://h/0?db=1&password=hunter2x&x=1",
            "redis://h/0?db=1&password=hunter2x",
            "bad URL redis://h/0?db=1&password=***&x=1",
        ),
        (  # echoed as arguments, each a word of its own
            "ERR unknown command 'HELLO', with args beginning with: '3' 'AUTH' 'bob' 'PW'",
            "redis://bob:PW@h/0",
            "ERR unknown command 'HELLO', with args beginning with: '3' 'AUTH' '***' '***'",
        ),
        (  # percent-encoded in the URL, sent (and echoed) decoded
            "WRONGPASS for 'p@ss:w'",
            "redis://u:p%40ss%3Aw@h/0",
            "WRONGPASS for '***'",
        ),
    ],
)
def test_the_credentials_are_cut_out_where_they_stand(message: str, url: str, said: str) -> None:
    assert scrub(message, url) == said


def test_a_bad_port_in_a_url_with_credentials_reads_whole_and_tells_none_of_them() -> None:
    url = "redis://u:PW@127.0.0.1:abc/0"
    with pytest.raises(ValueError) as refused:
        check_url(url)
    message = str(refused.value)
    assert (
        message == "not a Redis URL the client can use: the port must be a number from 1 to 65535"
    )
    with pytest.raises(ConfigError) as error:
        parse_config({"store": {"kind": "redis", "url": url}}, "config.toml")
    assert str(error.value) == f"config.toml: [store] url: {message}"

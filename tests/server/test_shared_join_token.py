"""With ``[cache] share_across_keys``, a background request of key B that joins key A's
stream gets a read token of its own: its reads take B's reader places and rate, never A's
(B could otherwise lock A out of its own stream and its rate), and the ``202``'s
``resumable`` is what its URL can do: B may leave and come back, so the stream waits for it
like a resumable one."""

from __future__ import annotations

import asyncio

from nexus.auth import hash_key
from nexus.server.state import HUB
from support import GatedProvider, MakeClient, chat

KEY_A = "nx-shared-a-0123456789abcdef"
KEY_B = "nx-shared-b-fedcba9876543210"
CHAT = "/v1/chat/completions"


SHARED = {
    "auth": {
        "keys": [
            {"name": "alpha", "sha256": hash_key(KEY_A)},
            {"name": "beta", "sha256": hash_key(KEY_B)},
        ]
    },
    "cache": {"enabled": True, "share_across_keys": True},
}
"""Two keys whose identical requests share one upstream call."""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_cross_key_background_joins_token_reads_as_its_own_key(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    config = {**SHARED, "limits": {"max_readers_per_key": 1}}
    client = await make_client(config, providers=[gated])
    body = chat(model="gated/m", stream=True)
    first = await client.post(CHAT, json=body, headers=bearer(KEY_A))
    stream_id = first.headers["X-Nexus-Stream-Id"]
    assert first.headers["X-Nexus-Resumable"] == "false"
    await asyncio.wait_for(first.content.readuntil(b"\n\n"), 5)
    try:
        joined = await client.post(CHAT, json=body | {"background": True}, headers=bearer(KEY_B))
        assert (joined.status, joined.headers["X-Nexus-Cache"]) == (202, "hit")
        accepted = await joined.json()
        assert accepted["id"] == stream_id
        assert accepted["read_token"].endswith(".beta")
        # Its URL reads the stream after B leaves and comes back: it says so, and the
        # stream now outlives its clients as a resumable one does.
        assert accepted["resumable"] is True
        assert client.app[HUB].live[stream_id].info.resumable is True
        # B's key alone still does not find A's stream.
        theirs = await client.get(f"/v1/streams/{stream_id}", headers=bearer(KEY_B))
        assert theirs.status == 404
        follower = await client.get(accepted["url"])
        assert follower.status == 200
        # B's one reader place is taken by its token read; A's is free for A.
        second = await client.get(accepted["url"])
        assert second.status == 429
        assert (await second.json())["error"]["code"] == "too_many_readers"
        own = await client.get(f"/v1/streams/{stream_id}", headers=bearer(KEY_A))
        assert own.status == 200
    finally:
        gated.gate.set()
    for response in (first, follower, own):
        assert (await response.read()).endswith(b"data: [DONE]\n\n")


async def test_a_cross_key_streaming_join_stays_not_resumable(make_client: MakeClient) -> None:
    """No token, no way back: it is told so, and A's stream is not made to wait for it."""
    gated = GatedProvider(before=1, after=1)
    config = SHARED
    client = await make_client(config, providers=[gated])
    body = chat(model="gated/m", stream=True)
    first = await client.post(CHAT, json=body, headers=bearer(KEY_A))
    await asyncio.wait_for(first.content.readuntil(b"\n\n"), 5)
    try:
        headers = bearer(KEY_B) | {"X-Nexus-Resumable": "true"}
        joined = await client.post(CHAT, json=body, headers=headers)
        assert joined.headers["X-Nexus-Resumable"] == "false"
        run = client.app[HUB].live[first.headers["X-Nexus-Stream-Id"]]
        assert run.info.resumable is False
    finally:
        gated.gate.set()
    await first.read()
    await joined.read()

"""One table of cases for the follow rule (CONTRACT section 3), run against each place that
applies it: its Python core (proxy/turn/rule.py `retry`), the Redis script's Lua copy that
decides across processes (proxy/registry/scripts.py RETRY, run by CLAIM_OR_FOLLOW), and the
WebSocket twin rule (proxy/websocket/fence.py, where a follow is a twin beside). They cannot
drift apart: a row changed in one fails the others."""

from __future__ import annotations

import pytest

from proxy.config.schema import OnRetry
from proxy.registry.scripts import CLAIM_OR_FOLLOW, RETRY
from proxy.turn.rule import Action, retry
from tests.redis_server import RedisServer, redis_client

ADAPTIVE, JOIN, SUPERSEDE = OnRetry.ADAPTIVE, OnRetry.JOIN, OnRetry.SUPERSEDE
NEW, FOLLOW, BESIDE = Action.NEW, Action.FOLLOW, Action.BESIDE

# identical body, same streaming mode, generation healthy, on_retry -> what the request does
CASES: list[tuple[bool, bool, bool, OnRetry, Action]] = [
    # the same request, asked again
    (True, True, True, ADAPTIVE, FOLLOW),
    (True, True, False, ADAPTIVE, NEW),  # a retry of a stalled stream replaces it
    (True, True, True, JOIN, FOLLOW),
    (True, True, False, JOIN, FOLLOW),  # join: pay once per turn, stalled or not
    (True, True, True, SUPERSEDE, NEW),
    (True, True, False, SUPERSEDE, NEW),
    # the same body in the other streaming mode (a non-streaming fallback)
    (True, False, True, ADAPTIVE, BESIDE),  # never the other mode's body
    (True, False, False, ADAPTIVE, NEW),
    (True, False, True, JOIN, BESIDE),
    (True, False, False, JOIN, NEW),
    (True, False, True, SUPERSEDE, NEW),
    (True, False, False, SUPERSEDE, NEW),
    # another body under the same turn key (an explicit X-Turn-Id)
    *[
        (False, same, alive, policy, NEW)
        for same in (True, False)
        for alive in (True, False)
        for policy in (ADAPTIVE, JOIN, SUPERSEDE)
    ],  # fmt: skip
]
IDS = [
    ",".join(
        (
            "same-body" if i else "other-body",
            "same-mode" if m else "other-mode",
            "healthy" if h else "stalled",
            str(p),
        )
    )
    for i, m, h, p, _ in CASES
]


def test_the_table_covers_every_case() -> None:
    assert len({case[:4] for case in CASES}) == len(CASES) == 2 * 2 * 2 * 3


@pytest.mark.parametrize(
    ("identical", "same_mode", "healthy", "on_retry", "action"), CASES, ids=IDS
)
def test_python(
    identical: bool, same_mode: bool, healthy: bool, on_retry: OnRetry, action: Action
) -> None:
    assert retry(identical, same_mode, healthy, on_retry) is action


async def test_lua_in_redis(single_redis: RedisServer) -> None:
    script = RETRY + ("return retry(ARGV[1] == '1', ARGV[2] == '1', ARGV[3] == '1', ARGV[4])")
    flag = {True: "1", False: "0"}
    async with redis_client(single_redis) as client:
        for identical, same_mode, healthy, on_retry, action in CASES:
            args = (flag[identical], flag[same_mode], flag[healthy], str(on_retry))
            answer = await client.eval(script, 0, *args)  # type: ignore[misc]
            assert answer == action.value.encode(), (identical, same_mode, healthy, on_retry)
    # ... and it is the rule the cross-process claim runs.
    assert RETRY in CLAIM_OR_FOLLOW and "retry(m[1] == ARGV[5], m[2] == ARGV[6]" in CLAIM_OR_FOLLOW


@pytest.mark.parametrize(
    ("identical", "same_mode", "healthy", "on_retry", "action"), CASES, ids=IDS
)
def test_the_websocket_twin_rule(
    identical: bool, same_mode: bool, healthy: bool, on_retry: OnRetry, action: Action
) -> None:
    """A response.create is always a streaming request: the same-mode rows. Where HTTP
    would follow, the twin goes beside (a Responses socket is stateful upstream)."""
    from proxy.websocket.attempts import twin_beside  # noqa: PLC0415

    if same_mode:
        assert twin_beside(identical, healthy, on_retry) is (action is FOLLOW)

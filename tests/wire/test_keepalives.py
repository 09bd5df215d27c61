"""What is a keep-alive, per dialect (proxy.wire.dialects; docs/keepalives.md), and the health rule
that keep-alives do not feed (proxy.wire.health), in Python and in the Redis script's Lua: pure
tables, the Lua one run by a real Redis."""

from __future__ import annotations

import pytest

from proxy.registry.scripts import CLAIM_OR_FOLLOW
from proxy.wire import dialects, health
from proxy.wire.dialects import ANTHROPIC, GEMINI, OPENAI_CHAT, OPENAI_RESPONSES, SSE
from proxy.wire.sse import SSESplitter, event_id, with_id
from tests.redis_server import RedisServer, redis_client

ALL = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC, GEMINI, SSE)
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
KEEPALIVE = b'event: keepalive\ndata: {"type":"keepalive","sequence_number":7}\n\n'

# (dialects, block, a keep-alive there). Blocks as the splitter hands them over.
CASES: list[tuple[tuple[str, ...], bytes, bool]] = [
    # Comment lines only: a keep-alive in every dialect.
    (ALL, b": ping\n\n", True),
    (ALL, b": OPENROUTER PROCESSING\n\n", True),  # OpenRouter
    (ALL, b": ping - 2025-06-01 12:00:00.000000\r\n\r\n", True),  # sse-starlette's default
    (ALL, b": keep-alive\n\n", True),  # vLLM --sse-keep-alive-interval
    (ALL, b":\n\n", True),
    (ALL, b":\r\r", True),
    (ALL, b": one\n: two\n\n", True),
    (ALL, b": ping\nid: 7-3\n\n", True),  # with the proxy's own id stamped on it
    (ALL, b": ping\nretry: 150\n\n", True),
    (ALL, b"\n: ping\n\n", True),  # after a stray blank line
    (ALL, b"\n\n", True),  # blank lines alone: nothing
    # A comment beside data is an event: content.
    (ALL, b": note\ndata: {}\n\n", False),
    (ALL, b": note\r\ndata: {}\r\n\r\n", False),
    (ALL, b": note\rdata\r\r", False),
    (ALL, b"\ndata: x\n\n", False),
    (ALL, b'data: {"choices":[]}\n\n', False),
    (ALL, b"data: [DONE]\n\n", False),
    (ALL, b"id: 1\ndata: x\n\n", False),
    # Named keep-alive events, as each dialect's providers send them.
    ((ANTHROPIC, SSE), PING, True),
    ((ANTHROPIC, SSE), b"event:ping\ndata: {}\n\n", True),
    ((ANTHROPIC, SSE), b"event: ping\r\ndata: {}\r\n\r\n", True),
    ((OPENAI_RESPONSES, SSE), KEEPALIVE, True),
    ((OPENAI_CHAT, OPENAI_RESPONSES, GEMINI), PING, False),  # not theirs: content
    ((OPENAI_CHAT, ANTHROPIC, GEMINI), KEEPALIVE, False),
    (ALL, b"event: pings\ndata: {}\n\n", False),
    (ALL, b"event: ping_me\ndata: {}\n\n", False),
    (ALL, b'event: message_start\ndata: {"type":"message_start"}\n\n', False),
    (ALL, b"event: response.output_text.delta\ndata: {}\n\n", False),
    # Told from the first bytes only: a ping named after another first line is content.
    (ALL, b'data: {"type": "ping"}\nevent: ping\n\n', False),
    (ALL, b"id: 3\nevent: ping\ndata: {}\n\n", False),
]


def _expand() -> list[tuple[str, bytes, bool]]:
    return [(d, block, expected) for ds, block, expected in CASES for d in ds]


@pytest.mark.parametrize(("dialect", "block", "expected"), _expand())
def test_keepalive_table(dialect: str, block: bytes, expected: bool) -> None:
    starts = dialects.keepalive_starts(dialect)
    assert dialects.is_keepalive(block, starts) is expected
    assert dialects.carries_content([block], starts) is not expected
    if block[0] not in dialects.keepalive_firsts(starts):  # the relay's one-byte test
        assert not expected
    # The proxy's id, stamped last on every event where resuming needs it, changes nothing
    # (but on a block of blank lines alone, which it turns into an id line: content then).
    if block.strip(b"\r\n"):
        assert dialects.is_keepalive(with_id(block, event_id(12, 3)), starts) is expected


@pytest.mark.parametrize("dialect", ALL)
def test_a_read_carries_content_when_any_of_its_events_does(dialect: str) -> None:
    starts = dialects.keepalive_starts(dialect)
    data = b'data: {"x":1}\n\n'
    assert dialects.carries_content([b": ping\n\n", data, b": ping\n\n"], starts)
    assert not dialects.carries_content([b": ping\n\n", b":\n\n"], starts)
    assert not dialects.carries_content([], starts)


def test_keepalives_are_told_apart_in_a_stream_however_it_is_read() -> None:
    """The splitter's blocks, whatever the reads' boundaries, are judged alike."""
    stream = (
        b'event: message_start\ndata: {"a":1}\n\n'
        + PING
        + b": comment\r\n\r\n"
        + b'event: content_block_delta\ndata: {"b":2}\n\n'
        + PING
    )
    starts = dialects.keepalive_starts(ANTHROPIC)
    for size in (1, 2, 3, 7, len(stream)):
        splitter = SSESplitter(1 << 20)
        reads = [stream[i : i + size] for i in range(0, len(stream), size)]
        blocks = [block for read in reads for block in splitter.feed(read)]
        kept = [dialects.is_keepalive(b, starts) for b in blocks]
        assert kept == [False, True, True, False, True]


def test_gemini_clients_never_get_a_keepalive() -> None:
    starts = dialects.keepalive_starts(GEMINI)
    assert dialects.drops_keepalives(GEMINI)
    assert not any(dialects.drops_keepalives(d) for d in ALL if d != GEMINI)
    data = b'data: {"candidates":[]}\n\n'
    events = [b": keepalive\n\n", data, b": ping\nid: 4-1\n\n", b": x\ndata: {}\n\n"]
    assert dialects.without_keepalives(events, starts) == [data, b": x\ndata: {}\n\n"]


@pytest.mark.parametrize(
    ("dialect", "event_type", "expected"),
    [
        (OPENAI_RESPONSES, "keepalive", True),
        (OPENAI_RESPONSES, "response.output_text.delta", False),
        (OPENAI_RESPONSES, "ping", False),
        (OPENAI_RESPONSES, None, False),
        (OPENAI_RESPONSES, ["keepalive"], False),
        (ANTHROPIC, "ping", True),
        (OPENAI_CHAT, "keepalive", False),
    ],
)
def test_a_keepalive_named_by_its_type(dialect: str, event_type: object, expected: bool) -> None:
    """Over a WebSocket an event's type is in its JSON (proxy.websocket.fence)."""
    assert dialects.names_keepalive(dialect, event_type) is expected


# --- the health rule: one table, Python and Lua --------------------------------------------

# (alive at, now, within): milliseconds, as the Lua rule reads Redis's clock.
HEALTH: list[tuple[int, int, int, bool]] = [
    (1000, 1000, 500, True),  # just sent content (or headers, or the request)
    (1000, 1499, 500, True),
    (1000, 1500, 500, False),  # exactly the window: stalled
    (1000, 9000, 500, False),
    (1000, 1000, 0, False),  # a zero window: never healthy
    (5000, 4990, 500, True),  # a stamp a little ahead of the reader's clock
]


@pytest.mark.parametrize(("alive_at", "now", "within", "expected"), HEALTH)
def test_health_in_python(alive_at: int, now: int, within: int, expected: bool) -> None:
    assert health.healthy(alive_at, now, within) is expected
    assert health.healthy(alive_at / 1000, now / 1000, within / 1000) is expected


async def test_health_in_lua_is_the_same_rule(single_redis: RedisServer) -> None:
    """The Redis script's rule (health.LUA, which CLAIM_OR_FOLLOW runs) on the same table."""
    script = health.LUA + (
        "return healthy(tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])) and 1 or 0"
    )
    async with redis_client(single_redis) as client:
        for alive_at, now, within, expected in HEALTH:
            got = await client.eval(script, 0, alive_at, now, within)  # type: ignore[misc]
            assert bool(got) is expected, (alive_at, now, within)
    assert CLAIM_OR_FOLLOW.startswith(health.LUA) and "healthy(tonumber(m[4])" in CLAIM_OR_FOLLOW


@pytest.mark.parametrize("dialect", sorted(dialects.DIALECTS))
def test_each_dialect_has_its_own_keepalives_and_an_unknown_one_those_of_plain_sse(
    dialect: str,
) -> None:
    own = dialects.keepalives(dialect)
    assert own.starts == dialects.keepalive_starts(dialect)
    assert own.dropped == dialects.drops_keepalives(dialect)
    assert dialects.keepalives("no-such-dialect") == dialects.keepalives(dialects.SSE)

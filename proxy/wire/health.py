"""When a generation is healthy (CONTRACT section 3): the one rule, on one clock.

A generation is healthy while the time since the later of its request, its response headers
and its last *content* event is under `healthy_within`. Keep-alives are not content
(`proxy.wire.dialects.carries_content` tells them apart): a stream that only pings is stalled, so
that a retry of it gets a fresh answer instead of waiting with the stuck one.

Every place that judges health calls `healthy`, with `time.monotonic()` readings: following
in one process (`proxy.turn.rule.decide`, through `Generation.healthy`), following a generation
of another process (`proxy.turn.remote`, from the writer's stamp on Redis) and the WebSocket twin
rule (`proxy.websocket.fence`). The Redis script that decides across processes in one atomic step
cannot call Python: it runs `LUA`, the same comparison on Redis's clock, checked against the
same table of cases (tests/test_health.py).
"""

from __future__ import annotations

from typing import Final


def healthy(alive_at: float, now: float, within: float) -> bool:
    """`alive_at`: the later of the request, its response headers and its last content
    event; `now`: the same clock's reading (time.monotonic, or Redis's in milliseconds)."""
    return now - alive_at < within


# The same rule in Lua, for scripts that decide on Redis (`last`, `now`, `within`: Redis's
# clock and the window, in milliseconds).
LUA: Final = "local function healthy(last, now, within) return now - last < within end\n"

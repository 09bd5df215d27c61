"""When a pooled upstream connection is kept, and when a request that failed on one may be
sent again: pure rules over a server's hint and the time it held the request
(proxy/upstream/connection.py and transport.py apply them).
"""

from __future__ import annotations

# A server's Keep-Alive hint is trusted this much: expire a second early, and never pool
# longer than a minute (a load balancer may still close sooner; the retry covers that).
HINT_MARGIN = 1.0
HINT_CAP = 60.0

# How soon after a request's first byte a reused connection may end (with no response byte)
# for the request to be sent again. A server that closed an idle connection as we reused it
# (its keep-alive timeout, a load balancer's) did so before it read our request: its FIN, or
# the RST its kernel answers our bytes with, reaches us about one round trip after our write
# (under a millisecond on loopback and within a data centre, tens of ms to a provider's
# nearest edge). A provider that took the request and then dropped the connection held it
# as long as it worked on it, which may have cost (and billed) a generation: sending it
# again would ask twice, and make the caller wait twice for the same failure. 100 ms is a
# round trip to a distant edge and far below any model's time to answer. A close later than
# that is a 502 with its cause, the request sent once; on a link slower than 100 ms the rare
# late race becomes a 502 too, which the official SDKs retry themselves: never a request
# asked twice by the proxy. (Go's transport never resends a POST it has written; this one
# resends only inside that window: docs/contract.md, "What the contract leaves open".)
RESEND_WITHIN = 0.1


def resends(held: float) -> bool:
    """A reused connection that ended `held` seconds after the request's first byte, with no
    response byte, ended before the server could have taken the request: send it again."""
    return held < RESEND_WITHIN


def keep_alive_expiry(value: bytes, default: float) -> float:
    """Seconds an idle connection may be kept, from a `Keep-Alive: timeout=N, max=M` hint."""
    for param in value.split(b","):
        name, _, number = param.strip().partition(b"=")
        if name.strip().lower() == b"timeout":
            try:
                seconds = float(number.strip())
            except ValueError:
                return default
            if seconds != seconds:  # NaN
                return default
            return max(0.0, min(seconds - HINT_MARGIN, HINT_CAP))
    return default

"""The fingerprint's cost on an agent-sized body: `python -m bench.fingerprint [KB]`.

Every request without an X-Turn-Id is fingerprinted on the event loop (proxy/wire/turns.py): its
JSON body parsed and written again in canonical form, then hashed. Agents send the whole
conversation each turn (Claude Code: 50-200 KB), so this is the largest per-request cost the
proxy has that the benchmark's small bodies do not show. Compared in the same run with the
canonical form written by the json module alone, which is what the fingerprint used before.
"""

from __future__ import annotations

import json
import random
import string
import sys
import timeit
from typing import Any

from proxy.wire.turns import _sha256, fingerprint_and_mode

IGNORE = ("stream", "stream_options", "timeout")


def agent_body(kb: int) -> bytes:
    """A Messages request of about `kb` KB: a system prompt, 30 tools, a conversation."""
    rng = random.Random(1)
    alphabet = string.ascii_letters + ' ,.é☃😀\n"'

    def text(n: int) -> str:
        return "".join(rng.choices(alphabet, k=n))

    body: dict[str, Any] = {
        "model": "claude-sonnet",
        "max_tokens": 32000,
        "stream": True,
        "temperature": 0.7,
        "system": [{"type": "text", "text": text(8000)}],
        "tools": [
            {
                "name": f"tool_{i}",
                "description": text(300),
                "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
            }
            for i in range(30)
        ],
        "messages": [],
    }
    while len(json.dumps(body)) < kb * 1024:
        role = "user" if len(body["messages"]) % 2 == 0 else "assistant"
        body["messages"].append({"role": role, "content": [{"type": "text", "text": text(1500)}]})
    return json.dumps(body).encode()


def json_module_fingerprint(route: str, path: str, body: bytes, ignore: tuple[str, ...]) -> str:
    """The fingerprint as the json module alone computed it (before orjson wrote the
    canonical form): the reference the property test in tests/wire/test_turns.py holds to."""
    parsed = json.loads(body)
    if isinstance(parsed, dict):
        for name in ignore:
            parsed.pop(name, None)
    canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    text = canonical.encode("utf-8", "surrogatepass")
    return _sha256(b"fingerprint", route.encode(), path.encode(), text)


def main() -> None:
    kb = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    body = agent_body(kb)
    ours = fingerprint_and_mode("default", "/v1/messages", body, IGNORE)[0]
    assert ours == json_module_fingerprint("default", "/v1/messages", body, IGNORE)  # the same
    rounds = 200
    now = timeit.timeit(
        lambda: fingerprint_and_mode("default", "/v1/messages", body, IGNORE), number=rounds
    )
    before = timeit.timeit(
        lambda: json_module_fingerprint("default", "/v1/messages", body, IGNORE), number=rounds
    )
    print(
        f"{len(body) / 1024:.0f} KB body: fingerprint {now / rounds * 1000:.3f} ms, json module"
        f" alone {before / rounds * 1000:.3f} ms ({now / before:.2f} x)"
    )


if __name__ == "__main__":
    main()

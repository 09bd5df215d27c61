"""Stream a chat completion through streamfence with the openai SDK.

    OPENAI_API_KEY=sk-... python examples/openai_client.py

The only change to an existing agent is `base_url`. `X-Turn-Id` is optional: without it the
proxy keys a turn by its conversation, so a retry of the same request fences the older one.
"""

import os
import sys

import openai

url = os.environ.get("STREAMFENCE_URL", "http://127.0.0.1:8787")
client = openai.OpenAI(
    base_url=f"{url}/v1",
    default_headers={"x-streamfence-token": os.environ.get("STREAMFENCE_TOKEN", "")},
)
try:
    stream = client.chat.completions.create(
        model=os.environ.get("MODEL", "gpt-4o-mini"),
        messages=[{"role": "user", "content": "Say hello in five words."}],
        stream=True,
        extra_headers={"X-Turn-Id": "example-turn-1"},  # optional; "none" opts out of fencing
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
except openai.APIError as exc:
    # A newer attempt of this turn won: this one must not be retried (the proxy says so
    # with x-should-retry: false, and the SDK honours it).
    if isinstance(exc.body, dict) and exc.body.get("code") == "stream_superseded":
        sys.exit(f"superseded by a newer attempt: {exc.message}")
    raise

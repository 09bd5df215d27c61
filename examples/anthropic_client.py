"""Stream a message through streamfence with the anthropic SDK.

    ANTHROPIC_API_KEY=sk-ant-... python examples/anthropic_client.py

Run the proxy with `--upstream https://api.anthropic.com` (or an [[upstream]] for it);
STREAMFENCE_URL (default http://127.0.0.1:8787) and STREAMFENCE_TOKEN say where it is.
"""

import os
import sys

import anthropic

url = os.environ.get("STREAMFENCE_URL", "http://127.0.0.1:8787")
client = anthropic.Anthropic(
    base_url=url,
    default_headers={"x-streamfence-token": os.environ.get("STREAMFENCE_TOKEN", "")},
)
try:
    with client.messages.stream(
        model=os.environ.get("MODEL", "claude-sonnet-4-5"),
        max_tokens=256,
        messages=[{"role": "user", "content": "Say hello in five words."}],
        extra_headers={"X-Turn-Id": "example-turn-2"},  # optional; "none" opts out of fencing
    ) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
    print()
except anthropic.APIError as exc:
    # A newer attempt of this turn won (an error event mid-stream, or 409 before it began):
    # this one must not be retried.
    if "stream_superseded" in str(exc.body):
        sys.exit(f"superseded by a newer attempt: {exc.message}")
    raise

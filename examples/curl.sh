#!/usr/bin/env sh
# Stream a chat completion through streamfence with plain curl, then look at what it saw.
#   STREAMFENCE_URL=http://127.0.0.1:8787 OPENAI_API_KEY=sk-... sh examples/curl.sh
set -eu
URL="${STREAMFENCE_URL:-http://127.0.0.1:8787}"
TOKEN="${STREAMFENCE_TOKEN:-}"

# -N: print events as they arrive. The response headers x-streamfence-turn and
# x-streamfence-attempt tell which turn (hashed) and attempt this was.
curl -sS -N -D - "$URL/v1/chat/completions" \
  -H "Authorization: Bearer ${OPENAI_API_KEY:-sk-none}" \
  -H "x-streamfence-token: $TOKEN" \
  -H "Content-Type: application/json" \
  -H "X-Turn-Id: example-turn-3" \
  -d '{"model": "'"${MODEL:-gpt-4o-mini}"'", "stream": true,
       "messages": [{"role": "user", "content": "Say hello in five words."}]}'

# The proxy's own endpoints (never forwarded):
curl -sS -H "x-streamfence-token: $TOKEN" "$URL/_streamfence/healthz"; echo
curl -sS -H "x-streamfence-token: $TOKEN" "$URL/_streamfence/metrics" | grep '^streamfence_requests_total' || true

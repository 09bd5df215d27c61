"""The Lua scripts of the Redis registry: each runs atomically inside Redis, so a claim
and a release can never interleave with another process's."""

from __future__ import annotations

from typing import Final

from proxy.wire import health

# The follow rule's core in Lua (proxy/turn/rule.py `retry`, which it copies: a script cannot
# call Python), for the claim that decides across processes. `on_retry`: adaptive, join or
# supersede. One table of cases checks both (tests/turn/test_rule_table.py).
RETRY: Final = """
local function retry(identical, same_mode, healthy, on_retry)
  if on_retry == 'supersede' or not identical then return 'new' end
  if not same_mode then
    if healthy then return 'beside' end
    return 'new'
  end
  if healthy or on_retry == 'join' then return 'follow' end
  return 'new'
end
"""

# A claim carries an id of its own (`by`), kept in the entry: redis-py sends a command again
# after a connection error, which may come after Redis ran it (the reply lost on the way).
# Run again, a claim answers what it answered the first time, instead of claiming over
# itself (or, in CLAIM_OR_FOLLOW, following its own new generation).
_AGAIN = """
local entry = redis.call('HMGET', KEYS[1], 'token', 'attempt', 'by', 'before')
if entry[3] == by then return {entry[1], entry[2], entry[4]} end
"""

# KEYS: turn entry, token counter. ARGV: ttl ms, channel, turn key, claim id. Runs after
# _AGAIN (the entry as read there) and `now` (Redis's TIME).
_CLAIM = """
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = redis.call('INCR', KEYS[2])
if token < floor then
  token = floor
  redis.call('SET', KEYS[2], string.format('%d', token))
end
local tok = string.format('%d', token)
local attempt = 1
if entry[2] then attempt = tonumber(entry[2]) + 1 end
local before = entry[1] or '0'
redis.call('HSET', KEYS[1], 'token', tok, 'attempt', attempt, 'before', before, 'by', by)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], 'c ' .. tok .. ' ' .. attempt .. ' ' .. before .. ' ' .. ARGV[3])
"""
CLAIM = (
    "local by = ARGV[4]"
    + _AGAIN
    + "local now = redis.call('TIME')"
    + _CLAIM
    + "return {tok, attempt, before}\n"
)

# The claim of a followable generation (CONTRACT section 3, across processes), atomic: if
# the turn's holder publishes a log (genlog) for an identical request, in the same streaming
# mode, whose writer is alive, the follow rule (RETRY, with proxy.wire.health's rule on the
# log's `last`, which moves on content only) answers {'follow', token, attempt, events
# published, ms since `last`} and claims nothing, or {'beside'}; otherwise it claims, and
# creates the new generation's log in the same step, so that a twin on another process a
# moment later finds it. The log's keys are built from the token (same hash tag as the entry:
# the same slot).
# KEYS: entry, counter. ARGV: ttl ms, channel, turn key, log prefix (up to the token), body
# hash, mode, healthy ms, on_retry, log ttl ms, maxlen, dead-after ms, reader id (also the
# claim id), reader ttl ms.
CLAIM_OR_FOLLOW = (
    health.LUA
    + RETRY
    + "local by = ARGV[12]"
    + _AGAIN
    + """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if entry[1] then
  local m = redis.call('HMGET', ARGV[4] .. entry[1] .. ':meta', 'body', 'mode', 'at', 'last',
    'ended', 'next')
  if m[1] and not m[5] and ms - tonumber(m[3]) <= tonumber(ARGV[11]) then
    local quiet = ms - tonumber(m[4])
    local alive = healthy(tonumber(m[4]), ms, tonumber(ARGV[7]))
    local action = retry(m[1] == ARGV[5], m[2] == ARGV[6], alive, ARGV[8])
    if action == 'follow' then
      -- Counted as a reader from now on: the writer must not close its upstream between
      -- this answer and the follower's first read.
      local readers = ARGV[4] .. entry[1] .. ':readers'
      redis.call('ZADD', readers, ms + tonumber(ARGV[13]), ARGV[12])
      redis.call('PEXPIRE', readers, ARGV[9])
      return {'follow', entry[1], entry[2], m[6] or '0', quiet}
    end
    if action == 'beside' then return {'beside'} end
  end
end
"""
    + _CLAIM
    + """
local log = ARGV[4] .. tok
local nows = string.format('%d', ms)
redis.call('DEL', log, log .. ':readers')
redis.call('HSET', log .. ':meta', 'body', ARGV[5], 'mode', ARGV[6], 'at', nows, 'last', nows)
redis.call('XADD', log, 'MAXLEN', '~', ARGV[10], '*', 'k', 'o')
redis.call('PEXPIRE', log, ARGV[9])
redis.call('PEXPIRE', log .. ':meta', ARGV[9])
return {tok, attempt, before}
"""
)

# KEYS: turn entry. ARGV: token. A stale release (a newer attempt holds the key) is a no-op.
RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: turn entry. ARGV: token, ttl ms. Keeps a long stream's entry alive and returns the
# holder, so a claim message missed while the subscriber was down is caught up on.
REFRESH = """
local cur = redis.call('HMGET', KEYS[1], 'token', 'attempt')
if cur[1] == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return cur
"""

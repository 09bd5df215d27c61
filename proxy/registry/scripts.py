"""The Lua scripts of the Redis registry: each runs atomically inside Redis, so a claim
and a release can never interleave with another process's."""

from __future__ import annotations

# KEYS: turn entry, token counter. ARGV: ttl ms, channel, turn key.
CLAIM = """
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = redis.call('INCR', KEYS[2])
if token < floor then
  token = floor
  redis.call('SET', KEYS[2], string.format('%d', token))
end
local tok = string.format('%d', token)
local prev = redis.call('HMGET', KEYS[1], 'token', 'attempt')
local attempt = 1
if prev[2] then attempt = tonumber(prev[2]) + 1 end
local before = prev[1] or '0'
redis.call('HSET', KEYS[1], 'token', tok, 'attempt', attempt)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], 'c ' .. tok .. ' ' .. attempt .. ' ' .. before .. ' ' .. ARGV[3])
return {tok, attempt, before}
"""

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

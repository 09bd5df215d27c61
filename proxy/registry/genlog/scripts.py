"""The Lua scripts of the generation log (`genlog`). Each touches one generation's three
keys, which share the turn's hash tag: one slot, one round trip.

KEYS: stream, meta hash, readers sorted set (member: reader id, score: its expiry in
Redis's own milliseconds, so no two processes' clocks are ever compared).
"""

from __future__ import annotations

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nows = string.format('%d', now)
"""

# ARGV: ttl ms, maxlen, body hash, streaming mode. A fresh log: its meta, an 'o' entry.
OPEN = (
    _NOW
    + """
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[2], 'body', ARGV[3], 'mode', ARGV[4], 'at', nows, 'last', nows)
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'k', 'o')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return nows
"""
)

# ARGV: ttl ms ('0': a batch between refreshes, which neither extends the expiry nor counts
# the readers: -2), maxlen, entry kind ('' for a heartbeat: no entry), alive ('1': the
# response headers, or a batch with content in it), m, then m meta field pairs, then the
# entry's field pairs. Stamps the writer's liveness (`at`, on every write) and, if alive,
# `last`: the later of the request, the response headers and the last content event, which
# the health rule reads (proxy.wire.health; keep-alives and heartbeats do not move it). Extends
# every key's expiry and returns how many readers are registered, or -1 if the log is gone
# (Redis restarted or evicted it): then it leaves an end readers can see, and the writer
# stops publishing.
WRITE = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1], KEYS[2]) < 2 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'k', 'e', 'o', 'lost')
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return -1
end
local m = tonumber(ARGV[5])
local hset = {'HSET', KEYS[2], 'at', nows}
if ARGV[4] == '1' then hset[#hset + 1] = 'last'; hset[#hset + 1] = nows end
for i = 6, 5 + 2 * m do hset[#hset + 1] = ARGV[i] end
redis.call(unpack(hset))
if ARGV[3] ~= '' then
  local xadd = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'k', ARGV[3]}
  for i = 6 + 2 * m, #ARGV do xadd[#xadd + 1] = ARGV[i] end
  redis.call(unpack(xadd))
end
if ARGV[1] == '0' then return -2 end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', nows)
return redis.call('ZCARD', KEYS[3])
"""
)

# ARGV: reader id ('' to only look), reader ttl ms, log ttl ms. Registers (or refreshes)
# the reader unless the log has ended, and returns {now, meta pairs...} ({now} if none).
FOLLOW = (
    _NOW
    + """
local meta = redis.call('HGETALL', KEYS[2])
if #meta == 0 then return {nows} end
if ARGV[1] ~= '' and redis.call('HEXISTS', KEYS[2], 'ended') == 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
table.insert(meta, 1, nows)
return meta
"""
)

# KEYS: the turn's registry entry. ARGV: the log key prefix of the turn (up to the token).
# The current holder's token and attempt, and its log's meta: the keys are built here from
# the token (same hash tag, so the same slot), which saves a round trip.
CURRENT = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'token', 'attempt')
if not cur[1] then return {nows} end
local meta = redis.call('HGETALL', ARGV[1] .. cur[1] .. ':meta')
return {nows, cur[1], cur[2], meta}
"""
)

# KEYS: readers, meta. ARGV: '1' to end the log if nobody reads it (atomically with the
# count: a follower deciding a moment later finds it ended and starts anew), else '0'.
READERS = (
    _NOW
    + """
local n = redis.call('ZCOUNT', KEYS[1], '(' .. nows, '+inf')
if n == 0 and ARGV[1] == '1' then redis.call('HSET', KEYS[2], 'ended', 'failed') end
return n
"""
)

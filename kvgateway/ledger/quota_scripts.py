"""The Redis side of fleet-wide tenant rate limits: key names and Lua scripts.

One sliding minute per tenant and limit, shared by every replica, as
:class:`~kvgateway.core.quota.RateWindow` keeps it in one process:

- ``{ns}:q:LIMIT:TENANT``   sorted set: charge id -> when it was charged (Redis ms)
- ``{ns}:qa:LIMIT:TENANT``  hash: charge id -> amount
- ``{ns}:qt:LIMIT:TENANT``  the amounts' sum

A charge is checked against every limit and added to all of them in one script, so two
replicas can never both take the last unit. Time is the Redis server's (``TIME``), so the
replicas' clocks do not matter. Keys expire a minute after their last charge.
"""

from __future__ import annotations

from dataclasses import dataclass

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Drop the charges that left the window; the sum left.
local function expire(z, a, t, before)
  while true do
    local old = redis.call('ZRANGEBYSCORE', z, '-inf', before, 'LIMIT', 0, 500)
    if #old == 0 then break end
    local amounts = redis.call('HMGET', a, unpack(old))
    local gone = 0
    for j = 1, #old do gone = gone + tonumber(amounts[j] or '0') end
    redis.call('ZREM', z, unpack(old))
    redis.call('HDEL', a, unpack(old))
    redis.call('DECRBY', t, gone)
  end
  return tonumber(redis.call('GET', t) or '0')
end
-- Ms until everything charged so far has left the window.
local function reset_in(z, now, window)
  local last = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return math.max(0, tonumber(last[2]) + window - now)
end
-- Ms until `excess` more has left the window (oldest first).
local function frees_in(z, a, excess, now, window)
  local start = 0
  while excess > 0 do
    local batch = redis.call('ZRANGE', z, start, start + 199, 'WITHSCORES')
    if #batch == 0 then return 0 end
    for j = 1, #batch, 2 do
      excess = excess - tonumber(redis.call('HGET', a, batch[j]) or '0')
      if excess <= 0 then return math.max(0, tonumber(batch[j + 1]) + window - now) end
    end
    start = start + 200
  end
  return 0
end
local function keep(z, a, t, ttl)
  redis.call('PEXPIRE', z, ttl)
  redis.call('PEXPIRE', a, ttl)
  redis.call('PEXPIRE', t, ttl)
end
"""

# KEYS: three per limit (window, amounts, sum). ARGV: window ms, charge id, then per
# limit: its value (-1: unlimited, the window only counts) and the amount asked.
# Returns {granted 0/1, index of the limit that refused (1-based, 0: none), ms until it
# frees (-1: never), then per limit: used (after the charge if granted), ms to reset}.
# Refused by several, the one that frees last is reported: retrying earlier fails again.
CHARGE = (
    _PRELUDE
    + """
local window, id = tonumber(ARGV[1]), ARGV[2]
local now = now_ms()
local n = #KEYS / 3
local used, limits, asks = {}, {}, {}
for i = 1, n do
  used[i] = expire(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], now - window)
  limits[i] = tonumber(ARGV[1 + 2 * i])
  asks[i] = tonumber(ARGV[2 + 2 * i])
end
local hit, wait = 0, -2
for i = 1, n do
  if limits[i] >= 0 and used[i] + asks[i] > limits[i] then
    local w = -1
    if asks[i] <= limits[i] then
      w = frees_in(KEYS[3 * i - 2], KEYS[3 * i - 1], used[i] + asks[i] - limits[i], now, window)
    end
    if wait ~= -1 and (w == -1 or w > wait) then hit, wait = i, w end
  end
end
local out = {hit == 0 and 1 or 0, hit, math.max(wait, -1)}
for i = 1, n do
  local z, a, t = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if hit == 0 then
    redis.call('ZADD', z, now, id)
    redis.call('HSET', a, id, asks[i])
    used[i] = redis.call('INCRBY', t, asks[i])
    keep(z, a, t, window + 1000)
  end
  out[#out + 1] = used[i]
  out[#out + 1] = reset_in(z, now, window)
end
return out
"""
)

# KEYS: three per limit. ARGV: charge id, then per limit its new amount. A charge that
# already left the window changes nothing.
ADJUST = """
local id = ARGV[1]
for i = 1, #KEYS / 3 do
  local z, a, t = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if redis.call('ZSCORE', z, id) then
    local old = tonumber(redis.call('HGET', a, id) or '0')
    local new = tonumber(ARGV[1 + i])
    redis.call('HSET', a, id, new)
    redis.call('INCRBY', t, new - old)
  end
end
return 1
"""

# KEYS: three for one limit. ARGV: window ms, then per charge: id, its age in ms, amount.
# Charges a replica admitted on its own share while Redis was away, added with their
# age so that they leave the window when they would have.
IMPORT = (
    _PRELUDE
    + """
local window = tonumber(ARGV[1])
local now = now_ms()
local z, a, t = KEYS[1], KEYS[2], KEYS[3]
for j = 2, #ARGV, 3 do
  local at = now - tonumber(ARGV[j + 1])
  if at > now - window and not redis.call('ZSCORE', z, ARGV[j]) then
    redis.call('ZADD', z, at, ARGV[j])
    redis.call('HSET', a, ARGV[j], ARGV[j + 2])
    redis.call('INCRBY', t, tonumber(ARGV[j + 2]))
  end
end
keep(z, a, t, window + 1000)
return 1
"""
)


@dataclass(frozen=True, slots=True)
class QuotaKeys:
    namespace: str

    def window(self, limit: str, tenant: str) -> tuple[str, str, str]:
        ns = self.namespace
        return (
            f"{{{ns}}}:q:{limit}:{tenant}",
            f"{{{ns}}}:qa:{limit}:{tenant}",
            f"{{{ns}}}:qt:{limit}:{tenant}",
        )

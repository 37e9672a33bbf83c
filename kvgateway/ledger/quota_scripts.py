"""The Redis side of fleet-wide tenant limits: key names and Lua scripts. The rate
windows are below; ``HOLD`` is the holdings check of :mod:`kvgateway.ledger.tenant_holds`.

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


# KEYS: live, the tenant's tokens and requests hashes, then per class its tokens and
# seqs hashes, then (with a backend's slots) per class its seqs hash on that backend.
# ARGV: me, check (1: judge this request; 0: only write mine), this request's tokens,
# its seqs, its class's index (1-based; 0: none), my tenant tokens and requests (this
# request included), the tenant's token and request caps (-1: none), the fleet's KV
# budget and slots, the number of classes, the request's backend's slots (0: none),
# then per class: my tokens and seqs (this request included), its floor in tokens and
# in seqs, my seqs on the backend (this request included), its floor there. Returns
# {held 0/1, the others' tenant tokens and requests, then per class the others' tokens
# and seqs, then per class the others' seqs on the backend}. As in one process: a
# tenant holding nothing anywhere may always run one request, however large; a floor
# keeps what its class does not hold, and binds the other classes only.
_HOLDINGS = """
local function others(key, livekey, me)
  local all = redis.call('HGETALL', key)
  local sum = 0
  for i = 1, #all, 2 do
    if all[i] ~= me then
      if redis.call('ZSCORE', livekey, all[i]) then
        sum = sum + tonumber(all[i + 1])
      else
        redis.call('HDEL', key, all[i])
      end
    end
  end
  return sum
end
local function put(key, me, v)
  if v > 0 then redis.call('HSET', key, me, v) else redis.call('HDEL', key, me) end
end
"""
HOLD = (
    _HOLDINGS
    + """
local me, check = ARGV[1], ARGV[2] == '1'
local this, this_seqs, own = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mt, mr, ct, cr = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local budget, slots = tonumber(ARGV[10]), tonumber(ARGV[11])
local n, node = tonumber(ARGV[12]), tonumber(ARGV[13])
local ot, orq = others(KEYS[2], KEYS[1], me), others(KEYS[3], KEYS[1], me)
local out = {1, ot, orq}
local held_t, held_s, floor_t, floor_s = {}, {}, {}, {}
local mine_t, mine_s, mine_n, held_n, floor_n = {}, {}, {}, {}, {}
local sum_t, sum_s, sum_n = 0, 0, 0
for c = 1, n do
  local a = 13 + 6 * (c - 1)
  mine_t[c], mine_s[c] = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  floor_t[c], floor_s[c] = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  mine_n[c], floor_n[c] = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local oct = others(KEYS[2 + 2 * c], KEYS[1], me)
  local ocs = others(KEYS[3 + 2 * c], KEYS[1], me)
  out[#out + 1], out[#out + 2] = oct, ocs
  held_t[c], held_s[c] = oct + mine_t[c], ocs + mine_s[c]
  sum_t, sum_s = sum_t + held_t[c], sum_s + held_s[c]
end
if node > 0 then
  for c = 1, n do
    local ons = others(KEYS[3 + 2 * n + c], KEYS[1], me)
    out[#out + 1] = ons
    held_n[c] = ons + mine_n[c]
    sum_n = sum_n + held_n[c]
  end
end
if check then
  local refused = (cr >= 0 and orq + mr > cr)
    or (ct >= 0 and ot + mt - this > 0 and ot + mt > ct)
  if own > 0 and not refused then
    local kept_t, kept_s, kept_n = 0, 0, 0
    for c = 1, n do
      if c ~= own then
        kept_t = kept_t + math.max(0, floor_t[c] - held_t[c])
        kept_s = kept_s + math.max(0, floor_s[c] - held_s[c])
        if node > 0 then kept_n = kept_n + math.max(0, floor_n[c] - held_n[c]) end
      end
    end
    refused = (kept_t > 0 and sum_t + kept_t > budget)
      or (slots > 0 and kept_s > 0 and sum_s + kept_s > slots)
      or (node > 0 and kept_n > 0 and sum_n + kept_n > node)
  end
  if refused then
    out[1] = 0
    return out
  end
end
put(KEYS[2], me, mt)
put(KEYS[3], me, mr)
for c = 1, n do
  put(KEYS[2 + 2 * c], me, mine_t[c])
  put(KEYS[3 + 2 * c], me, mine_s[c])
  if node > 0 then put(KEYS[3 + 2 * n + c], me, mine_n[c]) end
end
return out
"""
)

# KEYS: live, then per class its sorted set of replica -> since when (Redis ms) its
# oldest request waiting behind the floors has waited. ARGV: me, then per class how long
# mine has waited (ms; -1: none waits). Writes mine; returns per class how long the
# other live replicas' oldest has waited (ms; -1: none).
FLOOR_WAITS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 2, #KEYS do
  local age = tonumber(ARGV[i])
  if age >= 0 then
    redis.call('ZADD', KEYS[i], now - age, ARGV[1])
  else
    redis.call('ZREM', KEYS[i], ARGV[1])
  end
  local oldest = -1
  local all = redis.call('ZRANGE', KEYS[i], 0, -1, 'WITHSCORES')
  for j = 1, #all, 2 do
    if all[j] ~= ARGV[1] then
      if redis.call('ZSCORE', KEYS[1], all[j]) then
        oldest = math.max(oldest, now - tonumber(all[j + 1]))
      else
        redis.call('ZREM', KEYS[i], all[j])
      end
    end
  end
  out[#out + 1] = oldest
end
return out
"""

# KEYS: live, then per tenant its hash of KV tokens ever granted per replica. ARGV: me,
# then per tenant what this replica has granted it so far. Writes mine; returns per
# tenant what the other live replicas have granted it.
GRANTED = (
    _HOLDINGS
    + """
local out = {}
for i = 2, #KEYS do
  put(KEYS[i], ARGV[1], tonumber(ARGV[i]))
  out[#out + 1] = others(KEYS[i], KEYS[1], ARGV[1])
end
return out
"""
)

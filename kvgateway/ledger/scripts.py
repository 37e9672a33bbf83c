"""The Redis side of the shared ledger: key names and the Lua scripts that change them.

Layout (all keys share the ``{namespace}`` hash tag, so they live in one slot):

- ``{ns}:live``      sorted set: replica id -> lease expiry (Redis server time, ms)
- ``{ns}:tok:NAME``  hash: replica id -> KV tokens that replica holds on backend NAME
- ``{ns}:seq:NAME``  hash: replica id -> sequences it holds there
- ``{ns}:wait:NAME`` sorted set: replica id -> since when it has requests queued for NAME
- ``{ns}:released``  pub/sub channel: "NAME<TAB>total tokens<TAB>total seqs<TAB>replica"
  after a release, "wait<TAB>NAME<TAB>replica" after a refusal

Only holdings of replicas whose lease is live are summed; a dead replica's fields are
deleted by whoever reads them next, so a replica killed with -9 stops counting when its
lease runs out; one that was only frozen learns at its next call that its lease had
lapsed, and writes its holdings again. ``{ns}:epoch`` says when the ledger's data began:
a replica that finds another epoch than the one it knew (Redis restarted without
persistence, and every holding is gone) stalls every grant for a while (member
``!stall`` of the live set, scored with the stall's end), until each live replica has
found the same and written its holdings again; so does the first replica back after an
outage longer than every lease (Redis frozen or unreachable for all, its data kept),
which would otherwise find the others' leases lapsed and take their room. Time is the
Redis server's (``TIME``), so replicas' clocks do not matter. Under ``maxmemory`` every
script is refused at its first write, before it changed anything.

Fairness across replicas (approximately one FIFO queue): while another live replica has
requests queued for a backend, a *new* request elsewhere is refused there (it queues in its
own replica); only requests that waited in a queue take freed room. Each replica's own
queue is FIFO, and every release wakes every replica's queue.
"""

from __future__ import annotations

from dataclasses import dataclass

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Renew my lease. Says whether it had lapsed (my holdings may have been deleted
-- meanwhile: the caller writes them again), how many replicas are live, the ms a stall
-- has left, and the ledger's epoch: when its data began (a Redis that lost its data,
-- restarted without persistence, begins another). A replica that knew an earlier epoch
-- finds holdings missing, maybe everyone's: no grant until every live replica has had
-- time to find the same and write its holdings again (stall ms). So does the first
-- replica back from an outage that outlasted every lease (Redis frozen or cut off from
-- all, its data kept), or a replica that starts in it: its own lease lapsed (or it has
-- none yet), every other one has too, and the others' holdings go as it reads them. A
-- lease lost while another replica's is live (one replica frozen or cut off, a clean
-- stop under the same identity) stalls nothing; nor does a first start.
-- The stall is the member '!stall' of the live set, its score the stall's end.
-- The first write is the ZADD of my lease: Redis checks maxmemory at a script's first
-- write that may use memory, so under OOM the whole call is refused before anything
-- changed (a delete first let every later write through, and only releases failed).
local function live(key, epochkey, me, now, lease, known, stall)
  local prev = redis.call('ZSCORE', key, me)
  local lapsed = (not prev) or tonumber(prev) <= now
  local old_stall = redis.call('ZSCORE', key, '!stall')
  redis.call('ZADD', key, now + lease, me)
  local gone = redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if old_stall and tonumber(old_stall) <= now then gone = gone - 1 end
  local epoch = redis.call('GET', epochkey)
  if not epoch then
    epoch = string.format('%d', now)
    redis.call('SET', epochkey, epoch)
  end
  local ends = tonumber(redis.call('ZSCORE', key, '!stall') or '0')
  local lost_data = known ~= '0' and known ~= epoch
  -- Everyone's lease lapsed: mine (or I am new) and every other one, some just now.
  local others_live = redis.call('ZCARD', key) - 1 - (ends > now and 1 or 0)
  local all_lapsed = lapsed and gone > 0 and others_live == 0
  if (lost_data or all_lapsed) and now + stall > ends then
    ends = now + stall
    redis.call('ZADD', key, ends, '!stall')
  end
  local left = math.max(0, ends - now)
  local n = redis.call('ZCARD', key) - (left > 0 and 1 or 0)
  return n, lapsed and 1 or 0, left, epoch
end
-- Sum of the live replicas' holdings except mine; dead replicas' fields go.
local function others(key, livekey, me)
  local all = redis.call('HGETALL', key)
  local sum = 0
  for i = 1, #all, 2 do
    local who = all[i]
    if who ~= me then
      if redis.call('ZSCORE', livekey, who) then
        sum = sum + tonumber(all[i + 1])
      else
        redis.call('HDEL', key, who)
      end
    end
  end
  return sum
end
local function waiting(key, livekey, me)
  local all = redis.call('ZRANGE', key, 0, -1)
  for i = 1, #all do
    if all[i] ~= me then
      if redis.call('ZSCORE', livekey, all[i]) then return true end
      redis.call('ZREM', key, all[i])
    end
  end
  return false
end
local function note_waiting(key, me, now, flag)
  if flag then redis.call('ZADD', key, 'NX', now, me) else redis.call('ZREM', key, me) end
end
local function mine(key, me)
  return tonumber(redis.call('HGET', key, me) or '0')
end
"""

# KEYS: live, tok, seq, wait, epoch. ARGV: me, tokens, seqs, budget tokens, budget seqs,
# lease ms, queued (1: this request waited in a queue), still waiting (1: more of mine
# queue), channel, backend name, the epoch I know ('0': none yet), stall ms. Returns
# {granted 0/1, others' tokens, others' seqs, live replicas, 1 if my lease had lapsed, ms
# the stall has left, epoch}; a request refused for fairness or in a stall is told the
# backend is full, so that it queues instead of asking again. A refusal for fairness is
# published ("wait<TAB>NAME<TAB>replica"): other replicas give back their credit there.
RESERVE = (
    _PRELUDE
    + """
local me = ARGV[1]
local tokens, seqs = tonumber(ARGV[2]), tonumber(ARGV[3])
local bt, bs = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local n, lapsed, stall, epoch = live(
  KEYS[1], KEYS[5], me, now, tonumber(ARGV[6]), ARGV[11], tonumber(ARGV[12]))
local ot, os = others(KEYS[2], KEYS[1], me), others(KEYS[3], KEYS[1], me)
local mt, ms = mine(KEYS[2], me), mine(KEYS[3], me)
if stall > 0 then
  note_waiting(KEYS[4], me, now, true)
  return {0, math.max(ot, bt - mt), math.max(os, bs - ms), n, lapsed, stall, epoch}
end
local function refused()
  note_waiting(KEYS[4], me, now, true)
  redis.call('PUBLISH', ARGV[9], 'wait\t' .. ARGV[10] .. '\t' .. me)
end
if ARGV[7] ~= '1' and waiting(KEYS[4], KEYS[1], me) then
  refused()
  return {0, math.max(ot, bt - mt), math.max(os, bs - ms), n, lapsed, 0, epoch}
end
if ot + mt + tokens <= bt and os + ms + seqs <= bs then
  redis.call('HINCRBY', KEYS[2], me, tokens)
  redis.call('HINCRBY', KEYS[3], me, seqs)
  note_waiting(KEYS[4], me, now, ARGV[8] == '1')
  return {1, ot, os, n, lapsed, 0, epoch}
end
refused()
return {0, ot, os, n, lapsed, 0, epoch}
"""
)

# KEYS: live, tok, seq. ARGV: me, tokens, seqs, channel, backend name.
# Never below zero: a release can only give back what was recorded.
RELEASE = (
    _PRELUDE
    + """
local me = ARGV[1]
-- (0 - n, not -n: Lua writes -0 as "-0", which HINCRBY refuses.)
local t = redis.call('HINCRBY', KEYS[2], me, 0 - tonumber(ARGV[2]))
if t <= 0 then redis.call('HDEL', KEYS[2], me) end
local s = redis.call('HINCRBY', KEYS[3], me, 0 - tonumber(ARGV[3]))
if s <= 0 then redis.call('HDEL', KEYS[3], me) end
local ot = others(KEYS[2], KEYS[1], me) + math.max(t, 0)
local os = others(KEYS[3], KEYS[1], me) + math.max(s, 0)
redis.call('PUBLISH', ARGV[4], ARGV[5] .. '\\t' .. ot .. '\\t' .. os .. '\\t' .. me)
return {ot, os}
"""
)

# KEYS: live, epoch, then (tok_i, seq_i, wait_i) per backend. ARGV: me, lease ms,
# absolute (0/1), the epoch I know ('0': none yet), stall ms, then (tokens_i, seqs_i,
# waiting_i) per backend. With absolute=1 this replica's holdings are set to the given
# values (start-up, return from fallback, resync): never added on top of the past.
# Returns {live replicas, 1 if my lease had lapsed, ms the stall has left, epoch, others'
# tokens_1, others' seqs_1, 1 if another replica waits there_1, ...}.
HEARTBEAT = (
    _PRELUDE
    + """
local me = ARGV[1]
local now = now_ms()
local n, lapsed, stall, epoch = live(
  KEYS[1], KEYS[2], me, now, tonumber(ARGV[2]), ARGV[4], tonumber(ARGV[5]))
local absolute = ARGV[3] == '1'
local out = {n, lapsed, stall, epoch}
for i = 3, #KEYS, 3 do
  for k = 0, 1 do
    local key = KEYS[i + k]
    if absolute then
      local v = tonumber(ARGV[i + k + 3])
      if v > 0 then redis.call('HSET', key, me, v) else redis.call('HDEL', key, me) end
    end
    out[#out + 1] = others(key, KEYS[1], me)
  end
  note_waiting(KEYS[i + 2], me, now, ARGV[i + 5] == '1')
  out[#out + 1] = waiting(KEYS[i + 2], KEYS[1], me) and 1 or 0
end
return out
"""
)


# KEYS: wait. ARGV: me, 1 to enter (0 to leave), channel, backend name. Entering is
# published as a refusal is ("wait<TAB>NAME<TAB>replica"): replicas keeping credit there
# give it back.
MARK = (
    _PRELUDE
    + """
if ARGV[2] == '1' then
  redis.call('ZADD', KEYS[1], 'NX', now_ms(), ARGV[1])
  redis.call('PUBLISH', ARGV[3], 'wait\t' .. ARGV[4] .. '\t' .. ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"""
)


@dataclass(frozen=True, slots=True)
class Keys:
    namespace: str

    @property
    def live(self) -> str:
        return f"{{{self.namespace}}}:live"

    @property
    def epoch(self) -> str:
        return f"{{{self.namespace}}}:epoch"

    @property
    def channel(self) -> str:
        return f"{{{self.namespace}}}:released"

    def tokens(self, backend: str) -> str:
        return f"{{{self.namespace}}}:tok:{backend}"

    def seqs(self, backend: str) -> str:
        return f"{{{self.namespace}}}:seq:{backend}"

    def waiting(self, backend: str) -> str:
        return f"{{{self.namespace}}}:wait:{backend}"

    def backend(self, name: str) -> tuple[str, str, str]:
        return (self.live, self.tokens(name), self.seqs(name))


@dataclass(frozen=True, slots=True)
class Released:
    """A replica released on ``backend``: every live replica's holdings there now."""

    backend: str
    tokens: int
    seqs: int
    replica: str


@dataclass(frozen=True, slots=True)
class Refused:
    """Redis refused ``replica`` on ``backend``: it waits there."""

    backend: str
    replica: str


def parse_message(data: bytes) -> Released | Refused | None:
    """A message of the ``released`` channel, as RELEASE and RESERVE publish it (None:
    not one of theirs)."""
    fields = data.decode(errors="replace").split("\t")
    if len(fields) == 3 and fields[0] == "wait":
        return Refused(fields[1], fields[2])
    if len(fields) != 4:
        return None
    try:
        return Released(fields[0], int(fields[1]), int(fields[2]), fields[3])
    except ValueError:
        return None

-- wrk script for bench/overhead.py: POST the same ~1k-token chats as bench/loadgen.py,
-- every body distinct (a per-thread counter at the start of every 8th line, so no
-- cache of whole prompts or of line-aligned chunks can answer it), and print the
-- request count and p50/p99 latency as JSON at the end.
-- Usage: wrk -s bench/wrk_body.lua URL -- HEAD_FILE GROUPS_FILE TAIL_FILE
-- (GROUPS_FILE: the message's line groups separated by a 0x01 byte)
local next_id = 0

function setup(thread)
  thread:set("tid", next_id)
  next_id = next_id + 1
end

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local data = f:read("*a")
  f:close()
  return data
end

function init(args)
  head = slurp(args[1])
  groups = {}
  for g in string.gmatch(slurp(args[2]), "[^\1]+") do
    table.insert(groups, g)
  end
  tail = slurp(args[3])
  counter = 0
  headers = { ["Content-Type"] = "application/json" }
end

function request()
  counter = counter + 1
  local tag = "rw" .. tid .. "x" .. counter .. "z "
  local body = head .. tag .. table.concat(groups, "\\n" .. tag) .. tail
  return wrk.format("POST", nil, headers, body)
end

function done(summary, latency, requests)
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "errors": %d, "non2xx": %d, "p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status, latency:percentile(50), latency:percentile(99)))
end

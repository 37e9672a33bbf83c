-- wrk script for bench/overhead.py: POST a ~1k-token chat whose every body is distinct
-- (a per-thread counter in the message), and print p50/p99 latency as JSON at the end.
-- Usage: wrk -s bench/wrk_body.lua URL -- HEAD_FILE TAIL_FILE
local threads = {}
local next_id = 0

function setup(thread)
  thread:set("tid", next_id)
  next_id = next_id + 1
  table.insert(threads, thread)
end

function init(args)
  local f = assert(io.open(args[1], "rb"))
  head = f:read("*a")
  f:close()
  f = assert(io.open(args[2], "rb"))
  tail = f:read("*a")
  f:close()
  counter = 0
  headers = { ["Content-Type"] = "application/json" }
end

function request()
  counter = counter + 1
  local body = head .. "[wrk" .. tid .. "-" .. counter .. "]" .. tail
  return wrk.format("POST", nil, headers, body)
end

function done(summary, latency, requests)
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "errors": %d, "non2xx": %d, "p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status, latency:percentile(50), latency:percentile(99)))
end

"""The Lua scripts behind `shared.RedisShared`: each runs atomically in Redis, so every gateway
process sees and updates the same limits and in-flight counts. Functions are shared between the
entry points (admission and the first replica choice go together in one round trip)."""

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# GCRA ("generic cell rate algorithm"): each limit keeps one number, the theoretical arrival time
# (TAT) of the next request; a request is allowed while TAT stays within one period of now. It
# allows the whole minute's quota as a burst, then one request per (60 s / limit).
_ADMIT = """
-- keys: the key's and the tenant's TAT; the key's and the tenant's in-flight sets
-- argv: key per-minute limit, tenant per-minute limit, key concurrency, tenant concurrency,
--       request id, how long an in-flight entry may live (ms)
-- returns {allowed, reason, retry after ms, limit, remaining, reset ms}
local function admit(keys, argv)
  local period = 60000
  local limits = {tonumber(argv[1]), tonumber(argv[2])}
  local reasons = {'key_rpm', 'tenant_rpm'}
  local tats, intervals = {}, {}
  for i = 1, 2 do
    local tat = tonumber(redis.call('GET', keys[i])) or now
    if tat < now then tat = now end
    intervals[i] = period / limits[i]
    tats[i] = tat + intervals[i]
    local wait = tats[i] - period - now
    if wait > 0 then
      return {0, reasons[i], math.ceil(wait), limits[i], 0, math.ceil(tats[i] - intervals[i] - now)}
    end
  end
  local concurrency = {tonumber(argv[3]), tonumber(argv[4])}
  local busy = {'key_concurrency', 'tenant_concurrency'}
  for i = 1, 2 do
    redis.call('ZREMRANGEBYSCORE', keys[2 + i], '-inf', now)
    if redis.call('ZCARD', keys[2 + i]) >= concurrency[i] then
      return {0, busy[i], 1000, concurrency[i], 0, 1000}
    end
  end
  local best, best_left = 1, nil
  for i = 1, 2 do
    redis.call('SET', keys[i], string.format('%.3f', tats[i]), 'PX', math.ceil(tats[i] - now) + 1)
    redis.call('ZADD', keys[2 + i], now + tonumber(argv[6]), argv[5])
    redis.call('PEXPIRE', keys[2 + i], tonumber(argv[6]))
    local left = math.floor((period - (tats[i] - now)) / intervals[i])
    if best_left == nil or left < best_left then best, best_left = i, left end
  end
  -- The headers describe whichever per-minute limit is closer to running out.
  return {1, reasons[best], 0, limits[best], best_left, math.ceil(tats[best] - now)}
end
"""

# Least outstanding requests, with prefix affinity while the preferred replica is not overloaded.
# The chosen replica's log of routed requests (when each was sent there, and its prompt tokens)
# answers which requests were sent there since its load report, and when, which the report cannot
# show (the gateway follows the replica's queue through them: replica_choice.queued_tokens); the
# request joins the log. A request leaves it at its end (FINISH) or once older than any
# load report the gateway still reads.
_PICK = """
-- keys: per candidate replica, its in-flight set, its "down" marker, its routed log (time by
--       request) and the log's prompt tokens (by request)
-- argv: request id, in-flight entry lifetime (ms), affinity candidate (1-based; 0: none), max extra,
--       the request's prompt tokens, how long the log keeps a request (ms), then per candidate the
--       time of its load report (ms; 0: none)
-- returns the chosen candidate (1-based), now counted as outstanding there, and the requests
-- routed there since its load report (a flat list of their times and prompt tokens, in time order)
local function pick(keys, argv)
  local counts, up = {}, {}
  local best, best_up = 0, 0
  for i = 1, #keys / 4 do
    redis.call('ZREMRANGEBYSCORE', keys[4 * i - 3], '-inf', now)
    counts[i] = redis.call('ZCARD', keys[4 * i - 3])
    up[i] = redis.call('EXISTS', keys[4 * i - 2]) == 0
    if best == 0 or counts[i] < counts[best] then best = i end
    if up[i] and (best_up == 0 or counts[i] < counts[best_up]) then best_up = i end
  end
  -- Replicas that failed recently are passed over; if all did, the least busy is tried anyway.
  if best_up > 0 then best = best_up end
  local a = tonumber(argv[3])
  if a > 0 and (up[a] or best_up == 0) and counts[a] <= counts[best] + tonumber(argv[4]) then best = a end
  redis.call('ZADD', keys[4 * best - 3], now + tonumber(argv[2]), argv[1])
  redis.call('PEXPIRE', keys[4 * best - 3], tonumber(argv[2]))
  local log, tokens, keep = keys[4 * best - 1], keys[4 * best], tonumber(argv[6])
  local old = redis.call('ZRANGEBYSCORE', log, '-inf', now - keep, 'LIMIT', 0, 1000)
  if #old > 0 then
    redis.call('ZREM', log, unpack(old))
    redis.call('HDEL', tokens, unpack(old))
  end
  -- The requests routed there since its report, in the order sent: {time (ms), prompt tokens}...
  local routed = {}
  local since = redis.call('ZRANGEBYSCORE', log, tonumber(argv[6 + best]), '+inf', 'WITHSCORES')
  for first = 1, #since, 2000 do  -- unpack takes a bounded number of values
    local members = {}
    for i = first, math.min(first + 1999, #since), 2 do members[#members + 1] = since[i] end
    local counts = redis.call('HMGET', tokens, unpack(members))
    for i, n in ipairs(counts) do
      routed[#routed + 1] = since[first + 2 * i - 1]
      routed[#routed + 1] = tonumber(n) or 0
    end
  end
  if tonumber(argv[5]) > 0 then
    redis.call('ZADD', log, now, argv[1])
    redis.call('HSET', tokens, argv[1], argv[5])
    redis.call('PEXPIRE', log, keep)
    redis.call('PEXPIRE', tokens, keep)
  end
  return {best, routed}
end
"""

ADMIT = _NOW_MS + _ADMIT + "return admit(KEYS, ARGV)"

PICK = _NOW_MS + _PICK + "return pick(KEYS, ARGV)"

# KEYS: admit's four, then pick's; ARGV: admit's six, then pick's from its third on.
ADMIT_AND_PICK = (
    _NOW_MS
    + _ADMIT
    + _PICK
    + """
local admitted = admit({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, ARGV)
if admitted[1] == 0 then return admitted end
local candidates = {}
for i = 5, #KEYS do candidates[#candidates + 1] = KEYS[i] end
local args = {ARGV[5], ARGV[6]}
for i = 7, #ARGV do args[#args + 1] = ARGV[i] end
local picked = pick(candidates, args)
admitted[7], admitted[8] = picked[1], picked[2]
return admitted
"""
)

# The end of a request (or of one attempt at a replica).
# KEYS: the key's and the tenant's in-flight sets, the replica's in-flight set, its "down" marker,
#       the request's first-token mark, the replica's routed log and its prompt tokens (a key given
#       as "" is left alone)
# ARGV: request id, replica cool-down (ms; 0: it did not fail), first-token mark lifetime (ms; 0: none)
FINISH = """
for i = 1, 3 do
  if KEYS[i] ~= '' then redis.call('ZREM', KEYS[i], ARGV[1]) end
end
if KEYS[6] ~= '' then
  redis.call('ZREM', KEYS[6], ARGV[1])
  redis.call('HDEL', KEYS[7], ARGV[1])
end
if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[4], 1, 'PX', tonumber(ARGV[2])) end
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[5], 1, 'PX', tonumber(ARGV[3])) end
return 1
"""

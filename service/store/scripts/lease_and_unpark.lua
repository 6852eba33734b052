-- A reader joins or refreshes its lease, and reports how far it has delivered. A reader
-- that comes back to a parked request continues it: its job is queued again (ownerless,
-- the owner epoch bumped, in the takeover queue: a takeover's path), once, however many
-- come back at once. (The one lease script: named for what it may do besides.)
-- KEYS[1] meta, KEYS[2] readers, KEYS[3] its partition's queue, KEYS[4] its partition's
-- parked set, KEYS[5] log, KEYS[6] tails, KEYS[7] its partition's orphans (requests
-- waiting for a worker to continue them); ARGV[1] reader token, ARGV[2] lease expiry (ms),
-- ARGV[3] completion tokens delivered to this reader so far, ARGV[4] now (ms), ARGV[5] the
-- request id, ARGV[6] how long its keys must last from now when it goes on (ms), ARGV[7]
-- how long it waits for a worker then (ms)
-- Returns REPLY.LEASE_AND_UNPARK_ENDED (ended, or unknown: nothing to keep alive), _LEASED,
-- or _UNPARKED (leased, and the request was parked: it goes on)
local state = redis.call('HGET', KEYS[1], M.state)
if not state or TERMINAL[state] then
  return REPLY.LEASE_AND_UNPARK_ENDED  -- nothing left to keep alive
end
local unparked = T.unpark[state] ~= nil
if unparked then
  local now = tonumber(ARGV[4])
  local m = redis.call('HMGET', KEYS[1], M.parked_job, M.parked_ms)
  local entry = requeue_job(KEYS[3], m[1])
  redis.call('HINCRBY', KEYS[1], M.epoch, 1)
  redis.call('HSET', KEYS[1], M.state, S.RUNNING, M.owner, '', M.entry, entry,
    M.returned_ms, now)
  redis.call('HINCRBY', KEYS[1], M.paused_ms, now - tonumber(m[2] or now))
  redis.call('HDEL', KEYS[1], M.parked_job)
  redis.call('ZREM', KEYS[4], ARGV[5])
  redis.call('ZADD', KEYS[7], now + tonumber(ARGV[7]), ARGV[5])
  local keep = tonumber(ARGV[6])
  for _, key in ipairs({KEYS[1], KEYS[5], KEYS[6]}) do
    if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
  end
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HDEL', KEYS[1], M.gone_ms)
local delivered = tonumber(redis.call('HGET', KEYS[1], M.delivered) or '0')
if tonumber(ARGV[3]) > delivered then
  redis.call('HSET', KEYS[1], M.delivered, ARGV[3])
end
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
if unparked then return REPLY.LEASE_AND_UNPARK_UNPARKED end
return REPLY.LEASE_AND_UNPARK_LEASED

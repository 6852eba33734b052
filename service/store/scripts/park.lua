-- Park a running request whose readers are gone: its owner has taken it out of the engine
-- (everything it released is in the log); the request keeps its log and its job, holds no
-- worker, and goes on when a reader comes back within its resume window (lease_and_unpark.lua).
-- KEYS[1] meta, KEYS[2] readers, KEYS[3] its partition's queue, KEYS[4] its partition's
-- parked set (request id -> when its resume window is over, ms), KEYS[5] log, KEYS[6] tails,
-- KEYS[7] its partition's orphans (requests waiting for a worker to continue them)
-- ARGV[1] the owner's epoch, ARGV[2] its queue entry (acknowledged and deleted here),
-- ARGV[3] tokens the owner made that are not in the log (made again by whoever continues
-- it: wasted), ARGV[4] now (ms), ARGV[5] the request id, ARGV[6] how long the keys must
-- outlive the window (ms: a continuation's deadline and the finished log's TTL), ARGV[7]
-- how long a continuation waits for a worker (ms)
-- Returns {REPLY.PARK_PARKED, window end ms}; {REPLY.PARK_CONTINUED, entry}: a reader came
-- back meanwhile, so it is queued again at once (ownerless, in the takeover queue, as a
-- takeover); {REPLY.PARK_FENCED}: not the owner's to park (another worker took it over, or it ended). Either
-- way the owner is fenced out now.
local m = redis.call('HMGET', KEYS[1], M.epoch, M.state, M.grace_ms, M.gone_ms)
if m[1] ~= ARGV[1] or not T.park[m[2]] then return {REPLY.PARK_FENCED} end
local job = job_of(KEYS[3], ARGV[2])
if not job then return {REPLY.PARK_FENCED} end
local now = tonumber(ARGV[4])
redis.call('HINCRBY', KEYS[1], M.epoch, 1)
redis.call('HSET', KEYS[1], M.owner, '')
redis.call('HINCRBY', KEYS[1], M.discarded, ARGV[3])
ack_entry(KEYS[3], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) > 0 then
  local entry = requeue_job(KEYS[3], job)
  redis.call('HSET', KEYS[1], M.entry, entry)
  redis.call('ZADD', KEYS[7], now + tonumber(ARGV[7]), ARGV[5])
  return {REPLY.PARK_CONTINUED, entry}
end
local window = tonumber(m[4] or now) + tonumber(m[3] or '0')
redis.call('HSET', KEYS[1], M.state, S.PARKED, M.parked_job, job, M.parked_ms, now)
redis.call('HINCRBY', KEYS[1], M.parks, 1)
redis.call('HDEL', KEYS[1], M.entry)
redis.call('ZADD', KEYS[4], window, ARGV[5])
local keep = window - now + tonumber(ARGV[6])
for _, key in ipairs({KEYS[1], KEYS[5], KEYS[6]}) do
  if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
end
return {REPLY.PARK_PARKED, window}

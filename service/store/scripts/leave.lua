-- A reader's connection closed. When it was the last live lease, remember when.
-- KEYS[1] meta, KEYS[2] readers; ARGV[1] reader token, ARGV[2] now (ms),
-- ARGV[3] completion tokens delivered to this reader
-- Returns {REPLY.LEAVE_LEFT, live leases left, owner} (the API nudges the owner when none
-- are left), or {REPLY.LEAVE_GONE}: the request is not in Redis.
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return {REPLY.LEAVE_GONE} end
local delivered = tonumber(redis.call('HGET', KEYS[1], M.delivered) or '0')
if tonumber(ARGV[3]) > delivered then
  redis.call('HSET', KEYS[1], M.delivered, ARGV[3])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
local left = redis.call('ZCARD', KEYS[2])
if left == 0 and redis.call('HEXISTS', KEYS[1], M.gone_ms) == 0 then
  redis.call('HSET', KEYS[1], M.gone_ms, ARGV[2])
end
return {REPLY.LEAVE_LEFT, left, redis.call('HGET', KEYS[1], M.owner) or ''}

-- Per-key admission: concurrent requests and requests per minute, across API replicas.
-- KEYS[1] the key's in-flight set (request id -> expiry ms), KEYS[2] this minute's counter
-- ARGV[1] now (ms), ARGV[2] concurrency limit (0: none), ARGV[3] per-minute limit (0: none),
-- ARGV[4] request id, ARGV[5] in-flight expiry (ms; a slot is freed at the latest then)
-- Returns {REPLY.ADMIT_YES}; {REPLY.ADMIT_TOO_MANY_IN_FLIGHT, retry_ms};
-- {REPLY.ADMIT_OVER_RATE, retry_ms}.
local now = tonumber(ARGV[1])
local conc = tonumber(ARGV[2])
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= conc then return {REPLY.ADMIT_TOO_MANY_IN_FLIGHT, 1000} end
end
local rpm = tonumber(ARGV[3])
if rpm > 0 then
  local n = redis.call('INCR', KEYS[2])
  if n == 1 then redis.call('PEXPIRE', KEYS[2], 60000 - (now % 60000)) end
  if n > rpm then
    local ttl = redis.call('PTTL', KEYS[2])
    return {REPLY.ADMIT_OVER_RATE, ttl > 0 and ttl or 1000}
  end
end
if conc > 0 then
  redis.call('ZADD', KEYS[1], ARGV[5], ARGV[4])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]) - now)
end
return {REPLY.ADMIT_YES}

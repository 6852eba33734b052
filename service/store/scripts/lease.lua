-- A reader joins or refreshes its lease, and reports how far it has delivered.
-- KEYS[1] meta, KEYS[2] readers; ARGV[1] reader token, ARGV[2] lease expiry (ms),
-- ARGV[3] completion tokens delivered to this reader so far
local state = redis.call('HGET', KEYS[1], M.state)
if not state or TERMINAL[state] then
  return 0  -- nothing left to keep alive
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HDEL', KEYS[1], M.gone_ms)
local delivered = tonumber(redis.call('HGET', KEYS[1], M.delivered) or '0')
if tonumber(ARGV[3]) > delivered then
  redis.call('HSET', KEYS[1], M.delivered, ARGV[3])
end
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return 1

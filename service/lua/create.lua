-- Create a request's log with its `created` event, atomically.
-- KEYS[1] meta, KEYS[2] log
-- ARGV[1] encoded Created event, ARGV[2] safety TTL in seconds (nothing leaks if all dies),
-- ARGV[3] resume grace in ms, ARGV[4] '1' if detached (runs with no reader)
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.error_reply('EXISTS request already exists')
end
local id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[1])
redis.call('HSET', KEYS[1], 'epoch', 0, 'state', 'queued', 'last', id,
  'grace_ms', ARGV[3], 'detached', ARGV[4], 'delivered', 0)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return id

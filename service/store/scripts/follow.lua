-- A tail shard follows logs and leaves others, in one step (keys.py: tails, wake).
-- KEYS[1] the shard's wake stream; then ARGV[1] triples (meta, tails, log) of logs to
-- follow; then the tails sets of logs to leave.
-- The wake stream is made (or kept) first: an append that finds it gone forgets it. A log
-- still running gets the wake stream in its tails set (with the request's own TTL), so
-- that every append notifies it; an ended one does not (its tails set went with its end).
-- Either way the wake stream then names the log: the shard reads it once, after the
-- registration (what came before it is not missed, what comes after is notified).
redis.call('XADD', KEYS[1], 'MAXLEN', '~', WAKE_MAXLEN, '*', 'w', '1')
redis.call('EXPIRE', KEYS[1], 3600)
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  local meta, tails, log = KEYS[2 + 3 * i], KEYS[3 + 3 * i], KEYS[4 + 3 * i]
  local state = redis.call('HGET', meta, M.state)
  if state and not TERMINAL[state] then
    redis.call('SADD', tails, KEYS[1])
    local ttl = redis.call('TTL', meta)
    if ttl > 0 then redis.call('EXPIRE', tails, ttl) end
  end
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', WAKE_MAXLEN, '*', F.log, log)
end
for i = 2 + 3 * n, #KEYS do
  redis.call('SREM', KEYS[i], KEYS[1])
end
return n

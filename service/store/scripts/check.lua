-- The owner's periodic decision for a running request.
-- KEYS[1] meta, KEYS[2] readers; ARGV[1] now (ms), ARGV[2] the park delay (ms; -1: never
-- park)
-- Returns a Verdict: V.CANCELLED (cancel requested), V.PARK (no live lease for the park
-- delay, and a resume window longer than it: out of the engine, resumable), V.ABANDONED
-- (no live lease for the whole resume window, M.grace_ms, when that is no longer than
-- the park delay), V.KEEP_GOING; or -N: no live lease, parked or abandoned in N ms unless
-- a reader returns. Lapsed leases are removed; the moment the last one lapsed (or the
-- last reader left) is kept in M.gone_ms.
-- A request Redis forgot (a restart without its data) is not brought back to life as a
-- meta hash with only gone_ms in it (a key without a TTL): its owner learns at its next
-- append that it is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return V.KEEP_GOING end
local m = redis.call('HMGET', KEYS[1], M.cancel, M.detached, M.grace_ms, M.gone_ms)
if m[1] == '1' then return V.CANCELLED end
if m[2] == '1' then return V.KEEP_GOING end
local now = tonumber(ARGV[1])
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'WITHSCORES')
local last_lapse = nil
for i = 2, #lapsed, 2 do
  local t = tonumber(lapsed[i])
  if last_lapse == nil or t > last_lapse then last_lapse = t end
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) > 0 then
  redis.call('HDEL', KEYS[1], M.gone_ms)
  return V.KEEP_GOING
end
local gone = tonumber(m[4])
if gone == nil then
  gone = last_lapse or now
  redis.call('HSET', KEYS[1], M.gone_ms, gone)
end
local window = tonumber(m[3] or '0')
local park_after = tonumber(ARGV[2] or '-1')
if park_after >= 0 and window > park_after then
  local left = gone + park_after - now
  if left <= 0 then return V.PARK end
  return -math.ceil(left)
end
local left = gone + window - now
if left <= 0 then return V.ABANDONED end
return -math.ceil(left)

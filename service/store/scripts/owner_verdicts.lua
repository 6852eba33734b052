-- The owner's periodic decision for its running requests: many in one call (all of one
-- partition: one cluster slot).
-- KEYS: per request, meta and readers; ARGV[1] now (ms), ARGV[2] the park delay (ms; -1:
-- never park)
-- Returns one Verdict per request, in order: V.CANCELLED (cancel requested), V.PARK (no
-- live lease for the park delay, and a resume window longer than it: out of the engine,
-- resumable), V.ABANDONED (no live lease for the whole resume window, M.grace_ms, when
-- that is no longer than the park delay), V.KEEP_GOING; or -N: no live lease, parked or
-- abandoned in N ms unless a reader returns. Lapsed leases are removed; the moment the
-- last one lapsed (or the last reader left) is kept in M.gone_ms.
-- A request Redis forgot (a restart without its data) is not brought back to life as a
-- meta hash with only gone_ms in it (a key without a TTL): its owner learns at its next
-- append that it is gone.
local now = tonumber(ARGV[1])
local park_after = tonumber(ARGV[2] or '-1')

local function verdict(meta_key, readers_key)
  local m = redis.call('HMGET', meta_key, M.cancel, M.detached, M.grace_ms, M.gone_ms, M.state)
  if not m[5] then return V.KEEP_GOING end  -- (every request's meta has a state)
  if m[1] == '1' then return V.CANCELLED end
  if m[2] == '1' then return V.KEEP_GOING end
  if redis.call('ZCOUNT', readers_key, '(' .. now, '+inf') > 0 then  -- a live reader
    redis.call('ZREMRANGEBYSCORE', readers_key, '-inf', now)
    if m[4] then redis.call('HDEL', meta_key, M.gone_ms) end
    return V.KEEP_GOING
  end
  local gone = tonumber(m[4])
  if gone == nil then
    local last = redis.call('ZREVRANGE', readers_key, 0, 0, 'WITHSCORES')  -- (all lapsed)
    gone = tonumber(last[2]) or now
    redis.call('HSET', meta_key, M.gone_ms, gone)
  end
  redis.call('DEL', readers_key)  -- every lease there has lapsed
  local window = tonumber(m[3] or '0')
  if park_after >= 0 and window > park_after then
    local left = gone + park_after - now
    if left <= 0 then return V.PARK end
    return -math.ceil(left)
  end
  local left = gone + window - now
  if left <= 0 then return V.ABANDONED end
  return -math.ceil(left)
end

local out = {}
for i = 1, #KEYS, 2 do
  out[#out + 1] = verdict(KEYS[i], KEYS[i + 1])
end
return out

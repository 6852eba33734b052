-- Fenced append: XADD events only if the caller still owns the request.
-- KEYS[1] meta, KEYS[2] log, KEYS[3] readers (dropped at the terminal event), KEYS[4] outbox,
-- KEYS[5] scratch (the finished log is copied there and renamed back: see below)
-- ARGV[1] owner epoch, ARGV[2] terminal state ('' if not terminal),
-- ARGV[3] TTL in seconds applied to both keys when terminal,
-- ARGV[4] encoded Summary for the outbox ('' if not terminal), ARGV[5..] encoded events
-- Returns the new entry ids; errors FENCED (not the owner) or ENDED (already terminal).
-- The terminal event and its outbox entry are written together or not at all.
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'state')
if meta[1] ~= ARGV[1] then
  return redis.error_reply('FENCED owner epoch is ' .. tostring(meta[1]) .. ', not ' .. ARGV[1])
end
local state = meta[2]
if state == 'finished' or state == 'cancelled' or state == 'abandoned' or state == 'errored' then
  return redis.error_reply('ENDED request already ' .. state)
end
local ids = {}
for i = 5, #ARGV do
  ids[#ids + 1] = redis.call('XADD', KEYS[2], '*', 'e', ARGV[i])
end
if #ids > 0 then
  redis.call('HSET', KEYS[1], 'last', ids[#ids])
end
if ARGV[2] ~= '' then
  redis.call('DEL', KEYS[3])
  -- Right-size the finished log: Redis preallocates a stream node's listpack to
  -- stream-node-max-bytes (4 KiB by default) and never shrinks the last node, which
  -- for a short answer is most of its memory; a copy is allocated to fit.
  redis.call('COPY', KEYS[2], KEYS[5], 'REPLACE')
  redis.call('RENAME', KEYS[5], KEYS[2])
  redis.call('HSET', KEYS[1], 'state', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  if ARGV[4] ~= '' then
    redis.call('XADD', KEYS[4], '*', 's', ARGV[4], 'i', ids[#ids])
  end
end
return ids

-- Take ownership of a request: bump its owner epoch (fencing out any previous owner).
-- KEYS[1] meta; ARGV[1] worker id, ARGV[2] the queue entry the caller holds ('' for none:
-- a sweeper ending the request)
-- Returns {epoch, events in the log}; {-2} if the request is unknown (expired), {-1} if it
-- already ended, {-3} if the caller's queue entry is not the request's current one (the
-- job was queued again while the caller was frozen: another worker serves it). A claim by
-- the worker that already owns the running request (a retry after a lost reply) keeps
-- its epoch.
if redis.call('EXISTS', KEYS[1]) == 0 then return {-2} end
local m = redis.call('HMGET', KEYS[1], M.state, M.owner, M.epoch, M.events, M.entry)
local state = m[1]
if TERMINAL[state] then
  return {-1}
end
if ARGV[2] ~= '' and m[5] and m[5] ~= ARGV[2] then
  return {-3}
end
if state == S.RUNNING and m[2] == ARGV[1] then
  return {tonumber(m[3]), tonumber(m[4] or '0')}
end
local epoch = redis.call('HINCRBY', KEYS[1], M.epoch, 1)
redis.call('HSET', KEYS[1], M.owner, ARGV[1], M.state, S.RUNNING)
return {epoch, tonumber(m[4] or '0')}

-- Take ownership of a request: bump its owner epoch (fencing out any previous owner).
-- KEYS[1] meta, KEYS[2] log; ARGV[1] worker id, ARGV[2] the queue entry the caller holds
-- ('' for none: a sweeper ending the request)
-- Returns {REPLY.CLAIM_OK, epoch, events in the log, the log's first entry id, its event} (the last two
-- absent if the log is empty: one round trip for what a worker needs to start), after
-- REPLY.CLAIM_OK; {REPLY.CLAIM_GONE} if the request is unknown (expired), {REPLY.CLAIM_ENDED}
-- if it already ended, {REPLY.CLAIM_NOT_CURRENT} if the caller's queue entry is not the
-- request's current one (the job was queued again while the caller was frozen: another
-- worker serves it). A claim by
-- the worker that already owns the running request (a retry after a lost reply) keeps
-- its epoch.
if redis.call('EXISTS', KEYS[1]) == 0 then return {REPLY.CLAIM_GONE} end
local m = redis.call('HMGET', KEYS[1], M.state, M.owner, M.epoch, M.events, M.entry)
local state = m[1]
if not T.claim[state] then
  return {REPLY.CLAIM_ENDED}
end
if ARGV[2] ~= '' and m[5] and m[5] ~= ARGV[2] then
  return {REPLY.CLAIM_NOT_CURRENT}
end
local epoch
if state == S.RUNNING and m[2] == ARGV[1] then
  epoch = tonumber(m[3])
else
  epoch = redis.call('HINCRBY', KEYS[1], M.epoch, 1)
  redis.call('HSET', KEYS[1], M.owner, ARGV[1], M.state, S.RUNNING)
end
local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)[1]
if first then
  return {REPLY.CLAIM_OK, epoch, tonumber(m[4] or '0'), first[1], first[2][2]}
end
return {REPLY.CLAIM_OK, epoch, tonumber(m[4] or '0')}

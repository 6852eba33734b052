-- Cancel a request, in any phase.
-- KEYS[1] meta, KEYS[2] log, KEYS[3] its partition's outbox, KEYS[4] scratch (right-sizes
-- the log, as append.lua does), KEYS[5] tails (the tail shards to notify), KEYS[6] its
-- partition's parked set; ARGV[1] encoded End(cancelled) for a request still queued,
-- ARGV[2] TTL in seconds after the terminal event, ARGV[3] its encoded Summary, ARGV[4] /
-- ARGV[5] the End and Summary for a parked request, made from a log of ARGV[6] entries
-- (its ending counts the log's tokens), ARGV[7] the request id
-- (The caller frees the request's admission slot when it ended here: another slot.)
-- Returns {outcome, detail}: {REPLY.CANCEL_MISSING}; {<terminal state>} (no-op);
-- {S.CANCELLED, <end id>} (it was queued or parked: ended here, no engine will see it);
-- {REPLY.CANCEL_CANCELLING, <owner>} (running: its owner aborts it); {REPLY.CANCEL_STALE}
-- (parked, but its log is not the one the parked ending was made from: make it again).
if redis.call('EXISTS', KEYS[1]) == 0 then return {REPLY.CANCEL_MISSING} end
local m = redis.call('HMGET', KEYS[1], M.state, M.epoch, M.owner, M.events)
local state = m[1]
if not T.cancel[state] then
  return {state}
end
local ending, summary = nil, nil
if state == S.QUEUED and m[2] == '0' then
  ending, summary = ARGV[1], ARGV[3]
elseif state == S.PARKED then
  if ARGV[4] == '' or m[4] ~= ARGV[6] then return {REPLY.CANCEL_STALE} end
  ending, summary = ARGV[4], ARGV[5]
end
if ending then
  local id = redis.call('XADD', KEYS[2], '*', F.event, ending)
  redis.call('HSET', KEYS[1], M.state, S.CANCELLED, M.last, id, M.cancel, 1)
  redis.call('HDEL', KEYS[1], M.parked_job)
  redis.call('HINCRBY', KEYS[1], M.events, 1)
  redis.call('ZREM', KEYS[6], ARGV[7])
  notify(KEYS[5], KEYS[2])
  redis.call('DEL', KEYS[5])
  redis.call('COPY', KEYS[2], KEYS[4], 'REPLACE')
  redis.call('RENAME', KEYS[4], KEYS[2])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('XADD', KEYS[3], '*', F.summary, summary, F.end_id, id)
  return {S.CANCELLED, id}
end
redis.call('HSET', KEYS[1], M.cancel, 1)
return {REPLY.CANCEL_CANCELLING, m[3] or ''}

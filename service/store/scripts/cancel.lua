-- Cancel a request, in any phase.
-- KEYS[1] meta, KEYS[2] log, KEYS[3] its partition's outbox, KEYS[4] scratch (right-sizes
-- the log, as append.lua does), KEYS[5] tails (the tail shards to notify); ARGV[1] encoded End(cancelled) for a request still queued,
-- ARGV[2] TTL in seconds after the terminal event, ARGV[3] its encoded Summary
-- (The caller frees the request's admission slot when it ended here: another slot.)
-- Returns {outcome, detail}: {'missing'}; {<terminal state>} (no-op);
-- {'cancelled', <end id>} (it was queued: ended here, no engine will see it);
-- {'cancelling', <owner>} (running: its owner aborts it).
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local m = redis.call('HMGET', KEYS[1], M.state, M.epoch, M.owner)
local state = m[1]
if not T.cancel[state] then
  return {state}
end
if state == S.QUEUED and m[2] == '0' then
  local id = redis.call('XADD', KEYS[2], '*', F.event, ARGV[1])
  redis.call('HSET', KEYS[1], M.state, S.CANCELLED, M.last, id, M.cancel, 1)
  redis.call('HINCRBY', KEYS[1], M.events, 1)
  notify(KEYS[5], KEYS[2])
  redis.call('DEL', KEYS[5])
  redis.call('COPY', KEYS[2], KEYS[4], 'REPLACE')
  redis.call('RENAME', KEYS[4], KEYS[2])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('XADD', KEYS[3], '*', F.summary, ARGV[3], F.end_id, id)
  return {S.CANCELLED, id}
end
redis.call('HSET', KEYS[1], M.cancel, 1)
return {'cancelling', m[3] or ''}

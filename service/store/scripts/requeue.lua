-- Queue a job again behind a new entry in the partition's takeover queue (read by the
-- workers ahead of fresh work), which becomes the only one that may claim the request
-- (the old entry, in either queue, is acked and deleted):
-- * a job its worker took but never started (it froze, or died before claiming);
-- * a started request whose worker was lost (R.LOST, the sweeper) or is stopping and
--   hands it over (R.HANDOVER, the worker itself, with its epoch): the owner epoch is
--   bumped at once, fencing the old owner out, and the next worker's claim continues
--   the request from its log. A request lost ARGV[4] times already is not queued again.
-- KEYS[1] meta, KEYS[2] queue, KEYS[3] the requests waiting for a worker to continue them
-- (a sorted set: request id -> when to stop waiting, ms)
-- ARGV[1] the old entry id, ARGV[2] the consumer group, ARGV[3] R.LOST | R.HANDOVER,
-- ARGV[4] the most takeovers allowed, ARGV[5] the caller's owner epoch ('' for the
-- sweeper), ARGV[6] the request id, ARGV[7] when to stop waiting for a worker (ms)
-- Returns {REPLY.REQUEUE_OK, new entry id}; {REPLY.REQUEUE_EXHAUSTED, takeovers} when it
-- was lost too often; or {REPLY.REQUEUE_REFUSED} when the request is not waiting behind that entry (claimed by another, ended,
-- queued again already, or the caller is not its owner any more).
local m = redis.call('HMGET', KEYS[1], M.state, M.epoch, M.entry, M.takeovers, M.owner)
local state = m[1]
if not T.requeue[state] or (m[3] and m[3] ~= ARGV[1]) then return {REPLY.REQUEUE_REFUSED} end
if ARGV[5] ~= '' and m[2] ~= ARGV[5] then return {REPLY.REQUEUE_REFUSED} end
local started = state == S.RUNNING
if not started and m[2] ~= '0' then return {REPLY.REQUEUE_REFUSED} end
-- a continuation nobody claimed yet (a frozen worker's blocked read was handed it): it
-- moves to a new entry, but no worker was lost with it
local lost = started and (m[5] or '') ~= ''
if lost and ARGV[3] == R.LOST and tonumber(m[4] or '0') >= tonumber(ARGV[4]) then
  return {REPLY.REQUEUE_EXHAUSTED, tonumber(m[4] or '0')}
end
local job = job_of(KEYS[2], ARGV[1])
if not job then return {REPLY.REQUEUE_REFUSED} end
local entry = requeue_job(KEYS[2], job)
redis.call('HSET', KEYS[1], M.entry, entry)
if lost then
  redis.call('HINCRBY', KEYS[1], M.epoch, 1)
  redis.call('HSET', KEYS[1], M.owner, '')
  if ARGV[3] == R.LOST then
    redis.call('HINCRBY', KEYS[1], M.takeovers, 1)
  else
    redis.call('HINCRBY', KEYS[1], M.handovers, 1)
  end
  redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
end
ack_entry(KEYS[2], ARGV[1])
return {REPLY.REQUEUE_OK, entry}

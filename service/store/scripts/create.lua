-- Create a request's log with its `created` event, atomically -- and, in the same step,
-- its first reader's lease and its job on the queue (one round trip for the submit path;
-- a worker can never see the job before the log and the lease exist).
-- KEYS[1] meta, KEYS[2] log, KEYS[3] readers, KEYS[4] queue
-- ARGV[1] encoded Created event, ARGV[2] safety TTL in seconds (nothing leaks if all dies),
-- ARGV[3] resume grace in ms, ARGV[4] '1' if detached (runs with no reader),
-- ARGV[5] reader lease token ('' for none), ARGV[6] its expiry (ms),
-- ARGV[7] encoded job ('' to enqueue nothing)
-- Returns {REPLY.CREATE_OK, the created event's id}; {REPLY.CREATE_EXISTS} if another
-- request has the id. Run again with the same arguments (a retry after a lost reply), it
-- changes nothing and returns the same id.
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  -- the same call again (its reply was lost): the log starts with this very event
  local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)[1]
  if first and first[2][2] == ARGV[1] then return {REPLY.CREATE_OK, first[1]} end
  return {REPLY.CREATE_EXISTS}
end
local id = redis.call('XADD', KEYS[2], '*', F.event, ARGV[1])
redis.call('HSET', KEYS[1], M.epoch, 0, M.state, S.QUEUED, M.last, id,
  M.grace_ms, ARGV[3], M.detached, ARGV[4], M.delivered, 0, M.events, 1)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
if ARGV[5] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[5])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
if ARGV[7] ~= '' then
  local entry = redis.call('XADD', KEYS[4], '*', F.job, ARGV[7])
  redis.call('HSET', KEYS[1], M.entry, entry)
end
return {REPLY.CREATE_OK, id}

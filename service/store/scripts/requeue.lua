-- Queue a job again that its worker took but never started (it froze, or died before
-- claiming): a new queue entry for the same job, which becomes the only one that may claim.
-- KEYS[1] meta, KEYS[2] queue; ARGV[1] the old entry id, ARGV[2] the consumer group
-- Returns the new entry id, or false when the request is no longer waiting for a worker
-- behind that entry (it was claimed, ended, or queued again already).
local m = redis.call('HMGET', KEYS[1], M.state, M.epoch, M.entry)
if m[1] ~= S.QUEUED or m[2] ~= '0' or m[3] ~= ARGV[1] then return false end
local old = redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1])[1]
if not old then return false end
local job = nil
for i = 1, #old[2], 2 do
  if old[2][i] == F.job then job = old[2][i + 1] end
end
if not job then return false end
local entry = redis.call('XADD', KEYS[2], '*', F.job, job)
redis.call('HSET', KEYS[1], M.entry, entry)
redis.call('XACK', KEYS[2], ARGV[2], ARGV[1])
redis.call('XDEL', KEYS[2], ARGV[1])
return entry

-- Take ownership of a request: bump its owner epoch (fencing out any previous owner).
-- KEYS[1] meta; ARGV[1] worker id
-- Returns the new epoch, -2 if the request is unknown (expired), -1 if it already ended.
if redis.call('EXISTS', KEYS[1]) == 0 then return -2 end
local state = redis.call('HGET', KEYS[1], M.state)
if TERMINAL[state] then
  return -1
end
local epoch = redis.call('HINCRBY', KEYS[1], M.epoch, 1)
redis.call('HSET', KEYS[1], M.owner, ARGV[1], M.state, S.RUNNING)
return epoch

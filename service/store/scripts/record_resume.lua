-- A worker continues a request another one started (a takeover or a handover): it adds
-- the tokens it prefills again (prompt + the completion ids in the log), and learns the
-- request's recovery counts for its terminal event. Only the owner may.
-- KEYS[1] meta; ARGV[1] the caller's owner epoch, ARGV[2] tokens prefilled again
-- Returns {REPLY.RECORD_RESUME_OK, takeovers, handovers, tokens prefilled again in all, times parked, tokens thrown
-- away when parked, ms spent parked, when a reader came back to it (ms, 0: not since the
-- last continuation: this one answers it once)}, or {REPLY.RECORD_RESUME_FENCED} (not the
-- owner).
local m = redis.call('HMGET', KEYS[1], M.epoch, M.state)
if m[1] ~= ARGV[1] or m[2] ~= S.RUNNING then return {REPLY.RECORD_RESUME_FENCED} end
local total = redis.call('HINCRBY', KEYS[1], M.reprefill, ARGV[2])
local c = redis.call('HMGET', KEYS[1], M.takeovers, M.handovers, M.parks, M.discarded,
  M.paused_ms, M.returned_ms)
redis.call('HDEL', KEYS[1], M.returned_ms)
return {REPLY.RECORD_RESUME_OK, tonumber(c[1] or '0'), tonumber(c[2] or '0'), total, tonumber(c[3] or '0'),
  tonumber(c[4] or '0'), tonumber(c[5] or '0'), tonumber(c[6] or '0')}

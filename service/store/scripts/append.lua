-- Fenced appends for one or many requests in one call (a worker's whole flush: one
-- engine step of every request it runs). For each request, XADD its events only if the
-- caller still owns it and the log is where the caller thinks it is; the terminal event
-- and its outbox entry go together or not at all.
-- All the requests of one call are in one partition (one cluster slot) and one lane.
-- KEYS[1] the partition's outbox, KEYS[2] the lane's queue; then per request: meta, log, readers (dropped at the
-- terminal event), scratch (the finished log is copied there and renamed back: see below),
-- tails (the tail shards to notify: the prelude's wake_note and wake_send, once per call; dropped at the terminal event).
-- (The caller frees the request's admission slot after a terminal event: another slot.)
-- ARGV, per request: owner epoch, expected entries in the log before these ('' to not
-- check), terminal state ('' if not terminal), TTL in seconds applied to its keys when
-- terminal, encoded Summary for the outbox ('' if none), the queue entry the terminal event
-- acknowledges and deletes ('' if none), number of events n, the n events
-- Returns one array per request: {REPLY.APPEND_OK, <entry id>...}, or {<code>, <detail>}:
-- REPLY.APPEND_FENCED (not the owner) / _ENDED (already terminal) / _GAP (the log does not
-- hold what the caller wrote: Redis lost data) / _GONE (Redis lost the whole request) /
-- _INVALID (no terminal state), which leave that request untouched (the states a
-- step may go from and to: the prelude's T and TERMINAL, from lifecycle.TRANSITIONS). The same append
-- sent again (its reply was lost) is not written twice: it answers the ids it got.
local out = {}
local woken = wakes()  -- the tail shards to notify, once each at the end
local a, k = 1, 3
while a <= #ARGV do
  local epoch, expect, terminal = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local ttl, summary, ack = ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local n = tonumber(ARGV[a + 6])
  local first = a + 7
  local last = first + n - 1
  local meta_key, log_key, readers_key, scratch_key = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local tails_key = KEYS[k + 4]
  a, k = last + 1, k + 5
  local meta = redis.call('HMGET', meta_key, M.epoch, M.state, M.events)
  local state = meta[2]
  local have = tonumber(meta[3] or '0')
  if not meta[1] and not meta[2] then
    out[#out + 1] = {REPLY.APPEND_GONE, 'the request is not in Redis any more'}
  elseif meta[1] ~= epoch then
    out[#out + 1] = {REPLY.APPEND_FENCED, 'owner epoch is ' .. tostring(meta[1]) .. ', not ' .. epoch}
  elseif expect ~= '' and have == tonumber(expect) + n and n > 0 then
    -- already written by this very call: answer its ids again
    local ids = {REPLY.APPEND_OK}
    local written = redis.call('XREVRANGE', log_key, '+', '-', 'COUNT', n)
    for i = #written, 1, -1 do ids[#ids + 1] = written[i][1] end
    out[#out + 1] = ids
  elseif TERMINAL[state] then
    out[#out + 1] = {REPLY.APPEND_ENDED, 'request already ' .. state}
  elseif terminal ~= '' and not TERMINAL[terminal] then
    out[#out + 1] = {REPLY.APPEND_INVALID, terminal .. ' is not a terminal state'}
  elseif (terminal == '' and not T.append[state])
      or (terminal ~= '' and not (T.ending[state] or {})[terminal]) then
    out[#out + 1] = {REPLY.APPEND_FENCED, 'the request is ' .. tostring(state) .. ', not owned'}
  elseif expect ~= '' and have ~= tonumber(expect) then
    out[#out + 1] = {REPLY.APPEND_GAP, 'the log holds ' .. have .. ' entries, not ' .. expect}
  else
    local ids = {REPLY.APPEND_OK}
    for i = first, last do
      ids[#ids + 1] = redis.call('XADD', log_key, '*', F.event, ARGV[i])
    end
    if #ids > 1 then
      redis.call('HSET', meta_key, M.last, ids[#ids], M.events, have + #ids - 1)
      wake_note(woken, tails_key, log_key)
    end
    if terminal ~= '' then
      redis.call('DEL', readers_key, tails_key)
      -- Right-size the finished log: Redis preallocates a stream node's listpack to
      -- stream-node-max-bytes (4 KiB by default) and never shrinks the last node, which
      -- for a short answer is most of its memory; a copy is allocated to fit.
      if redis.call('EXISTS', log_key) == 1 then
        redis.call('COPY', log_key, scratch_key, 'REPLACE')
        redis.call('RENAME', scratch_key, log_key)
      end
      redis.call('HSET', meta_key, M.state, terminal)
      redis.call('HDEL', meta_key, M.parked_job)
      redis.call('EXPIRE', meta_key, ttl)
      redis.call('EXPIRE', log_key, ttl)
      if summary ~= '' then
        local end_id = ids[#ids]
        if #ids == 1 then end_id = redis.call('HGET', meta_key, M.last) or '' end
        redis.call('XADD', KEYS[1], '*', F.summary, summary, F.end_id, end_id)
      end
      if ack ~= '' then ack_entry(KEYS[2], ack) end
    end
    out[#out + 1] = ids
  end
end
wake_send(woken)
return out

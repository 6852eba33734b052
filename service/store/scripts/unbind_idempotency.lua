-- Unbind an Idempotency-Key from the request it was bound to, if it still is (the request
-- was refused before it was created, so a retry with the same key may try again).
-- KEYS[1] the key's binding ("<request id> <body digest>"); ARGV[1] the request id
-- Returns REPLY.UNBIND_IDEMPOTENCY_UNBOUND, or _NOT_BOUND (bound to another, or expired).
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  redis.call('DEL', KEYS[1])
  return REPLY.UNBIND_IDEMPOTENCY_UNBOUND
end
return REPLY.UNBIND_IDEMPOTENCY_NOT_BOUND

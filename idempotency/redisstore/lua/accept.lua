#!lua
-- accept.lua: the single-round-trip accept (Store.AcceptStep): it checks the
-- idempotency record and, for a new key, runs a write of the package that owns the
-- written keys and stores the response, in one script. It is a template: write(keys,
-- argv), its slot, is the function of the Step it runs (queue.EnqueueStep's enqueue, or
-- Accept's enqueue_stream.lua), composed in by internal/redisscript; this file never
-- sees that function's text, and the function sees none of this file's locals.
--
--   KEYS[1]  the record key (<prefix>:{<tag>}:idem:<hash>)
--   KEYS[2:] the step's keys, in the record's hash slot: write's keys
--   ARGV[1]  the fingerprint
--   ARGV[2]  the final record to store (encodeDone)
--   ARGV[3]  the result TTL in milliseconds
--   ARGV[4:] the step's args: write's argv
--
-- Returns {0} when the fingerprint differs (the key was reused), {1} when an
-- in-progress marker of the generic path holds the key, {2, record} for a replay
-- (nothing written), {3} when accepted.
--
-- Invariant: a key is accepted at most once per result TTL: the write and the stored
-- response happen together or not at all (the write raises its errors before its first
-- write, the response is stored after it, and the shebang makes Redis refuse the whole
-- script, not half of it, when out of memory), so there is no crash window between
-- enqueueing and storing the response and no in-progress state.
local v = redis.call('GET', KEYS[1])
if v then
  local fp = ARGV[1] .. '\n'
  if string.sub(v, 2, #fp + 1) ~= fp then return {0} end
  if string.sub(v, 1, 1) ~= 'D' then return {1} end
  return {2, v}
end
local wkeys, wargv = {}, {}
for i = 2, #KEYS do wkeys[#wkeys + 1] = KEYS[i] end
for i = 4, #ARGV do wargv[#wargv + 1] = ARGV[i] end
write(wkeys, wargv)
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {3}

-- wake.lua: makes a job that waits in the scheduled set due now (a signal it waits for
-- arrived), or, when it is not in the set (running, or queued), leaves a wake mark in
-- its index that the settlement putting it there turns into "due now" (schedule.lua).
-- So a wake is never lost between a job deciding to wait and its settlement.
--
--   KEYS[1]  the scheduled set
--   KEYS[2]  the job index
--   ARGV[1]  the tenant that must own the job
--   ARGV[2]  what the wake is for, as the index's "waiting" field says it ("signal
--            payment"); "" for whatever the job waits for
--
-- Returns the job's scheduled-set member when it was waiting and is due now (Wake then
-- moves it with move.lua), 2 when the mark was left, 3 when the job waits in the set for
-- something else (left alone: a signal it does not wait for does not run it), 0 when the
-- job has no index, or another tenant's.
--
-- Invariant: the job stays in exactly the one place it was (the scheduled set, the
-- stream); only its due time or its index's mark changes.
local st = redis.call('HMGET', KEYS[2], 'state', 'scheduled', 'tenant', 'waiting')
if not st[1] then return 0 end
if (st[3] or '') ~= ARGV[1] then return 0 end
if st[1] == 'scheduled' and st[2] and redis.call('ZSCORE', KEYS[1], st[2]) then
  if ARGV[2] ~= '' and (st[4] or '') ~= '' and st[4] ~= ARGV[2] then return 3 end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[1], 'XX', now, st[2])
  redis.call('HSET', KEYS[2], 'run_at', now)
  redis.call('HDEL', KEYS[2], 'wake')
  return st[2]
end
redis.call('HSET', KEYS[2], 'wake', '1')
return 2

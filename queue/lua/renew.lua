-- renew.lua: resets the idle time of entries the caller still owns, and records when
-- their runs started (the worker's lease renewal).
--
--   KEYS[1]  the stream
--   KEYS[2]  the runs hash (Keys.Runs)
--   ARGV[1]  consumer group
--   ARGV[2]  consumer (the caller)
--   ARGV[3:] pairs of an entry id and the Unix millisecond time its run started
--
-- Returns {ids owned by another consumer or no longer pending, ids deleted from the
-- stream while pending}. XCLAIM with JUSTID and min-idle-time 0 resets the idle time
-- without incrementing the delivery counter. Each owned entry's start is kept in the
-- runs hash (HSETNX: the first renewal's), since renewals hide a long run's age from its
-- idle time; the worker deletes it when it settles the entry.
--
-- Invariant: only entries still pending to ARGV[2] are claimed; a plain XCLAIM would
-- take back an entry another worker reclaimed after a pause of ours, and both would run
-- it at once.
local owned, lost = {}, {}
for i = 3, #ARGV - 1, 2 do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    owned[#owned + 1] = ARGV[i]
    redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
local deleted = {}
if #owned > 0 then
  local args = {KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(owned) do args[#args + 1] = id end
  args[#args + 1] = 'JUSTID'
  local claimed = {}
  for _, id in ipairs(redis.call('XCLAIM', unpack(args))) do claimed[id] = true end
  for _, id in ipairs(owned) do
    if not claimed[id] then
      deleted[#deleted + 1] = id
      redis.call('HDEL', KEYS[2], id)
    end
  end
end
return {lost, deleted}

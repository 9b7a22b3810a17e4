-- delete_consumers.lua: deletes the idle consumers of a group that hold nothing
-- (queue.DeleteIdleConsumers).
--
--   KEYS[1]  the stream
--   ARGV[1]  consumer group
--   ARGV[2]  consumer never to delete (the caller)
--   ARGV[3]  idle threshold in milliseconds
--
-- Returns the names deleted.
--
-- Invariant: XGROUP DELCONSUMER drops a consumer's pending entries from the PEL, losing
-- them; the script deletes only consumers with 0 pending, checked in the same atomic
-- step, so no pending entry is ever lost this way.
local deleted = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if info['name'] ~= ARGV[2] and info['pending'] == 0 and info['idle'] > tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    deleted[#deleted + 1] = info['name']
  end
end
return deleted

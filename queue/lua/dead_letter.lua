-- dead_letter.lua: moves one pending entry to the dead-letter stream (the worker's
-- dead-lettering of a job).
--
--   KEYS[1]  the stream
--   KEYS[2]  the dead-letter stream
--   KEYS[3]  (optional) the job index, left out when the message has no valid job id
--   ARGV[1]  consumer group
--   ARGV[2]  consumer that must own the entry
--   ARGV[3]  entry id
--   ARGV[4]  reason
--   ARGV[5]  failed_at, Unix milliseconds
--   ARGV[6]  tenant, or "" when unknown
--   ARGV[7]  the attempts the job spent, or 0 to record the entry's delivery count
--   ARGV[8]  the delivery's history event (a JSON object; the script adds "dead"), or
--            "" for none
--   ARGV[9:] the dead-letter record's field/value list; the script appends
--            "deliveries" with ARGV[7] or the entry's delivery count from the PEL
--
-- Returns the dead-letter entry id, or nil when the entry is no longer pending to
-- ARGV[2] (acknowledged, or reclaimed by another consumer whose run now decides).
--
-- Invariant: XADD to the dead-letter stream, XACK and the index's state=failed happen
-- together or not at all, and only the entry's current owner moves it, so one entry
-- never yields two dead letters. The index loses its TTL and its "entry" (so that no
-- trim gives it one once the entry is removed: see trim_batch.lua): it must outlive the
-- record it points to (a purge gives it a TTL back).
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #p == 0 then return false end
local rec = {}
for i = 9, #ARGV do rec[#rec + 1] = ARGV[i] end
rec[#rec + 1] = 'deliveries'
if tonumber(ARGV[7]) > 0 then rec[#rec + 1] = ARGV[7] else rec[#rec + 1] = tostring(p[1][4]) end
local dead = redis.call('XADD', KEYS[2], '*', unpack(rec))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
if KEYS[3] then
  redis.call('HSET', KEYS[3], 'state', 'failed', 'reason', ARGV[4], 'dead_id', dead, 'failed_at', ARGV[5])
  redis.call('HDEL', KEYS[3], 'entry')
  if ARGV[6] ~= '' then redis.call('HSETNX', KEYS[3], 'tenant', ARGV[6]) end
  redis.call('PERSIST', KEYS[3])
  if ARGV[8] ~= '' then history(KEYS[3], string.sub(ARGV[8], 1, -2) .. ',"dead":"' .. dead .. '"}') end
end
return dead

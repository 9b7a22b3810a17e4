-- reclaim.lua: claims idle entries and reads their delivery counts in one step (the
-- worker's reclaim).
--
--   KEYS[1]  the stream
--   ARGV[1]  consumer group
--   ARGV[2]  consumer
--   ARGV[3]  min idle time in milliseconds
--   ARGV[4]  the scan cursor
--   ARGV[5]  the most entries to claim
--
-- Returns {next cursor, {{id, fields}...}, {deleted ids}, {delivery count of each
-- claimed entry}}.
--
-- Invariant: the claim, which spends a delivery of each entry, never happens without
-- its counts reaching the worker that must run the entries (an XPENDING that failed
-- after a successful XAUTOCLAIM left entries claimed and unrun until the next
-- ClaimIdle, their delivery spent).
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local msgs, counts = {}, {}
for _, m in ipairs(r[2]) do
  if type(m) == 'table' then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], m[1], m[1], 1)
    msgs[#msgs + 1] = m
    counts[#counts + 1] = (#p > 0) and p[1][4] or 0
  end
end
return {r[1], msgs, r[3] or {}, counts}

-- read_history.lua: reads a job's history in one step (queue.ReadHistory): its index's
-- appended events and moved success record, and the success record of its latest entry
-- while that is still in the successes hash (acknowledged, not yet trimmed).
--
--   KEYS[1]  the job index
--   KEYS[2]  the successes hash
--   ARGV     none
--
-- Returns {history, done, success of the latest entry}, each nil when absent.
--
-- Invariant: it writes nothing; its reads are one atomic step, so a trim moving the
-- latest success from the hash into the index between them cannot hide it.
local v = redis.call('HMGET', KEYS[1], 'history', 'done', 'entry')
local s = false
if v[3] then s = redis.call('HGET', KEYS[2], v[3]) end
return {v[1], v[2], s}

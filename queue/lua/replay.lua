-- replay.lua: re-enqueues a dead letter and removes it (queue.Replay).
--
--   KEYS[1]  the stream
--   KEYS[2]  the dead-letter stream
--   KEYS[3]  the job index
--   ARGV[1]  dead-letter entry id
--   ARGV[2]  the time, Unix milliseconds, for the job's history
--   ARGV[3]  when the dead letter's job was enqueued, Unix milliseconds, for its history
--   ARGV[4]  the job's tenant, then as enqueue.lua's argv:
--   ARGV[5:] the new entry's field/value list
--
-- Returns the new entry id, or nil when the dead letter no longer exists. It enqueues
-- with enqueue.lua, so the index says queued again, without a TTL, exactly as for any
-- enqueue (which also retires the dead letter the index points at, when that is another
-- one of the same job).
--
-- Invariant: the job is back in the stream exactly when its dead letter is gone, so two
-- concurrent replays enqueue it once.
if #redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1]) == 0 then return false end
local argv = {}
for i = 4, #ARGV do argv[#argv + 1] = ARGV[i] end
local id = enqueue(KEYS, argv)
redis.call('XDEL', KEYS[2], ARGV[1])
history(KEYS[3], cjson.encode({outcome = 'replayed', entry = id, dead = ARGV[1], ['end'] = tonumber(ARGV[2]), enqueued = tonumber(ARGV[3])}))
return id

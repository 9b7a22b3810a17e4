-- enqueue_at.lua: enqueue_at(keys, argv), the enqueue of a job that runs at a time
-- (queue.EnqueueAt alone, queue.EnqueueAtStep in another package's script). It checks
-- the job id as enqueue.lua does, adds the job to the scheduled set, and records in the
-- index tenant, state=scheduled, run_at and the member (and no entry). A worker's mover
-- (move.lua) adds it to the stream once it is due.
--
--   KEYS[1]  the stream (Keys.Stream)
--   KEYS[2]  the dead-letter stream (Keys.Dead)
--   KEYS[3]  the job index (Keys.Job(job_id))
--   KEYS[4]  the scheduled set (Keys.Scheduled)
--   KEYS[5]  the scheduled entries (Keys.ScheduledData)
--   ARGV[1]  the job's tenant ("" for none)
--   ARGV[2]  the Unix millisecond time it runs at
--   ARGV[3]  the set member ("<job id> <token>", a fresh token)
--   ARGV[4:] the entry's field/value list (Message.Values)
--
-- Returns the member.
--
-- Invariant: as for enqueue.lua, a job is never scheduled in the index while the dead
-- letter it points at exists, and its index does not expire while it waits.
local function enqueue_at(keys, argv)
  local f = check_job_id(keys, argv)
  redis.call('ZADD', keys[4], argv[2], argv[3])
  redis.call('HSET', keys[5], argv[3], cjson.encode({unpack(argv, 4)}))
  retire(keys, f)
  redis.call('HSET', keys[3], 'tenant', argv[1], 'state', 'scheduled', 'run_at', argv[2], 'scheduled', argv[3])
  redis.call('HDEL', keys[3], 'entry')
  redis.call('PERSIST', keys[3])
  return argv[3]
end

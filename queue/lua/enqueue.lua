-- enqueue.lua: the queue's enqueue, enqueue(keys, argv), the one piece of code that adds
-- a job to the stream and writes its index. queue.Enqueue runs it alone (keys and argv
-- are KEYS and ARGV), the replay of a dead letter runs it (replay.lua), and a script of
-- another package that must enqueue in the same atomic step as writes of its own (the
-- accept of idempotency/redisstore) runs it through queue.EnqueueStep.
--
--   KEYS[1]  the stream (Keys.Stream)
--   KEYS[2]  the dead-letter stream (Keys.Dead)
--   KEYS[3]  the job index (Keys.Job(job_id))
--   ARGV[1]  the job's tenant ("" for none)
--   ARGV[2:] the entry's field/value list (Message.Values)
--
-- The three keys share the queue's hash slot. It adds the entry, and the index gets
-- tenant, state=queued and entry (the new entry id) and loses any TTL: the index of a
-- job in the stream never expires (the worker's maintenance gives it
-- WorkerConfig.JobTTL when it trims the acknowledged entry). When the index records a
-- failure, the job was asked for again and runs again, as after a replay (retire in
-- jobindex.lua). It raises JOBIDTAKEN when the job's index names another tenant, and
-- WRONGTYPE when a key holds another type, both before its first write (it reads the
-- index first, and XADD is its first write), so a script that writes only after it
-- returns writes all or nothing. In the common case it costs four commands: HMGET,
-- XADD, HSET, PERSIST.
--
-- Returns the new entry id.
--
-- Invariant: a job is never queued in the index while the dead letter it points at
-- exists, nor expires from the index while queued.
local function enqueue(keys, argv)
  local f = check_job_id(keys, argv)
  local id = redis.call('XADD', keys[1], '*', unpack(argv, 2))
  retire(keys, f)
  redis.call('HSET', keys[3], 'tenant', argv[1], 'state', 'queued', 'entry', id)
  redis.call('PERSIST', keys[3])
  return id
end

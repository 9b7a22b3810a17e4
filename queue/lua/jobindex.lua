-- jobindex.lua: the job index rules every enqueue of a job follows (enqueue.lua,
-- enqueue_at.lua), as two functions of the enqueue's keys:
--
-- check_job_id(keys, argv) reads the job's index and refuses, before any write, a job id
-- whose index names another tenant (the error JOBIDTAKEN: queue.ErrJobIDTaken), and an
-- index pointing at a dead letter while the dead-letter key holds another type than a
-- stream (WRONGTYPE). retire(keys, f) is what an enqueue does after its first write to
-- the index of a job asked for again: the dead letter the index points at is deleted and
-- the failure's fields (reason, dead_id, failed_at, last_error) removed. The job's new
-- entry has no attempts field: it runs again with its whole budget.
--
--   KEYS[1]  the stream (Keys.Stream)
--   KEYS[2]  the dead-letter stream (Keys.Dead)
--   KEYS[3]  the job index (Keys.Job(job_id))
--   ARGV[1]  the job's tenant ("" for none)
--
-- Returns check_job_id: the index's {state, dead_id, tenant} (HMGET); retire: nothing.
--
-- Invariant: a job id is one job: an enqueue never takes over, or writes anything to,
-- another tenant's job; and a job is never queued in the index while the dead letter
-- it points at exists.
local function check_job_id(keys, argv)
  local f = redis.call('HMGET', keys[3], 'state', 'dead_id', 'tenant')
  if f[3] and f[3] ~= argv[1] then
    error({err = 'JOBIDTAKEN the job id ' .. keys[3] .. ' belongs to another tenant'})
  end
  if f[2] then
    local t = redis.call('TYPE', keys[2]).ok
    if t ~= 'stream' and t ~= 'none' then
      error({err = 'WRONGTYPE ' .. keys[2] .. ' holds a ' .. t .. ', not a stream'})
    end
  end
  return f
end

local function retire(keys, f)
  if f[2] then redis.call('XDEL', keys[2], f[2]) end
  if f[1] == 'failed' or f[2] then redis.call('HDEL', keys[3], 'reason', 'dead_id', 'failed_at', 'last_error') end
end

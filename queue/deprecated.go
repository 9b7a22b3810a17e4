package queue

import "time"

// EnqueueLua is the queue's enqueue as it was exported before the queue's scripts moved
// to .lua files: the body of a Lua function of (keys, argv), with keys
// Keys.EnqueueKeys(job_id) and argv EnqueueArgs(m), returning the new entry id. Its
// text is frozen at this release (it does what lua/enqueue.lua does today) and nothing
// in onceflow uses it.
//
// Deprecated: use EnqueueStep, the queue's enqueue as a Step, and
// redisstore.Store.AcceptStep; this constant goes in a later release.
const EnqueueLua = `
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

local id = redis.call('XADD', keys[1], '*', unpack(argv, 2))

if f[2] then redis.call('XDEL', keys[2], f[2]) end
if f[1] == 'failed' or f[2] then redis.call('HDEL', keys[3], 'reason', 'dead_id', 'failed_at', 'last_error') end

redis.call('HSET', keys[3], 'tenant', argv[1], 'state', 'queued', 'entry', id)
redis.call('PERSIST', keys[3])
return id
`

// EnqueueAtLua is EnqueueLua for a job that runs at a time, as it was exported before
// the queue's scripts moved to .lua files: keys Keys.EnqueueAtKeys(job_id), argv
// EnqueueAtArgs(m, at), returning the set member. Its text is frozen at this release
// and nothing in onceflow uses it.
//
// Deprecated: use EnqueueAtStep and redisstore.Store.AcceptStep; this constant goes in
// a later release.
const EnqueueAtLua = `
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

redis.call('ZADD', keys[4], argv[2], argv[3])
redis.call('HSET', keys[5], argv[3], cjson.encode({unpack(argv, 4)}))

if f[2] then redis.call('XDEL', keys[2], f[2]) end
if f[1] == 'failed' or f[2] then redis.call('HDEL', keys[3], 'reason', 'dead_id', 'failed_at', 'last_error') end

redis.call('HSET', keys[3], 'tenant', argv[1], 'state', 'scheduled', 'run_at', argv[2], 'scheduled', argv[3])
redis.call('HDEL', keys[3], 'entry')
redis.call('PERSIST', keys[3])
return argv[3]
`

// EnqueueKeys returns the keys of the queue's enqueue of jobID, in order: the stream,
// the dead-letter stream and the job index.
//
// Deprecated: use EnqueueStep, which carries its keys; this forwarder goes in a later
// release.
func (k Keys) EnqueueKeys(jobID string) []string { return k.enqueueKeys(jobID) }

// EnqueueAtKeys returns the keys of the queue's enqueue at a time of jobID, in order.
//
// Deprecated: use EnqueueAtStep, which carries its keys; this forwarder goes in a later
// release.
func (k Keys) EnqueueAtKeys(jobID string) []string { return k.enqueueAtKeys(jobID) }

// EnqueueArgs returns the arguments of the queue's enqueue of m: its tenant, then its
// fields (Message.Values). A zero m.EnqueuedAt is set to the current time. An m that
// fails Validate gives an error wrapping ErrMalformed.
//
// Deprecated: use EnqueueStep, which carries its args; this forwarder goes in a later
// release.
func EnqueueArgs(m Message) ([]any, error) { return enqueueArgs(m) }

// EnqueueAtArgs returns the arguments of the queue's enqueue of m to run at at: its
// tenant, the time, a fresh set member, then its fields. A zero m.EnqueuedAt is set to
// the current time; an m that fails Validate gives an error wrapping ErrMalformed.
//
// Deprecated: use EnqueueAtStep, which carries its args; this forwarder goes in a later
// release.
func EnqueueAtArgs(m Message, at time.Time) ([]any, error) { return enqueueAtArgs(m, at) }

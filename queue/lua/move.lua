-- move.lua: moves due scheduled jobs to the stream (queue.MoveDue).
--
--   KEYS[1]  the stream
--   KEYS[2]  the scheduled set
--   KEYS[3]  the scheduled entries
--   KEYS[4]  the dead-letter stream
--   KEYS[5:] the job index of each member, in the order of ARGV (KEYS[4 + i] is the
--            index of ARGV[i]'s job)
--   ARGV[1:] the members
--
-- A member moves only when it is still in the set and due by Redis' clock now. When the
-- index still points at this member (a later enqueue of the job may have replaced it),
-- it says queued with the new entry, without a TTL; and, as for any enqueue of a job
-- whose index records a failure (enqueue.lua), the dead letter it points at is retired,
-- so the index never says queued while that dead letter exists.
--
-- Returns how many moved.
--
-- Invariant: a member's removal from the set, the XADD of its entry and the index update
-- are one step, so two movers racing move it once, and a crash on either side of the
-- script leaves it in exactly one place.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local moved = 0
for i = 1, #ARGV do
  local m = ARGV[i]
  local s = redis.call('ZSCORE', KEYS[2], m)
  if s and tonumber(s) <= now then
    local raw = redis.call('HGET', KEYS[3], m)
    redis.call('ZREM', KEYS[2], m)
    redis.call('HDEL', KEYS[3], m)
    if raw then
      local id = redis.call('XADD', KEYS[1], '*', unpack(cjson.decode(raw)))
      local ix = KEYS[4 + i]
      if redis.call('HGET', ix, 'scheduled') == m then
        local dead = redis.call('HGET', ix, 'dead_id')
        if dead then redis.call('XDEL', KEYS[4], dead) end
        redis.call('HDEL', ix, 'scheduled', 'run_at', 'reason', 'dead_id', 'failed_at', 'waiting')
        redis.call('HSET', ix, 'state', 'queued', 'entry', id)
        redis.call('PERSIST', ix)
      end
      moved = moved + 1
    end
  end
end
return moved

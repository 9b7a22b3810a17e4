-- trim_batch.lua: releases the job indexes of a batch of acknowledged entries and trims
-- them from the stream; each entry's success record moves from the successes hash into
-- its job's index (field "done", when the index exists). queue.Trim runs it per batch.
--
--   KEYS[1]  the stream
--   KEYS[2]  the successes hash (Keys.Successes)
--   KEYS[3:] the job index of each entry, in order
--   ARGV[1]  index TTL in milliseconds
--   ARGV[2]  the MINID to trim to (just above the batch's last entry)
--   ARGV[3:] the entry ids, in the order of KEYS[3:] (ARGV[i] is KEYS[i]'s entry)
--
-- Returns the number of entries trimmed. An index gets the TTL only when its "entry" is
-- the trimmed entry and the job has no copy in the scheduled set ("scheduled"): not when
-- the job was enqueued again and a newer entry, or a delayed one, waits (its index must
-- not expire while it does), and not when the job was dead-lettered (dead_letter.lua
-- removes "entry": the index must outlive the dead letter).
--
-- Invariant: an index expires only after its job left the stream.
for i = 3, #KEYS do
  local rec = redis.call('HGET', KEYS[2], ARGV[i])
  if rec then
    if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('HSET', KEYS[i], 'done', rec) end
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
  if redis.call('HGET', KEYS[i], 'entry') == ARGV[i] and redis.call('HEXISTS', KEYS[i], 'scheduled') == 0 then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
  end
end
return redis.call('XTRIM', KEYS[1], 'MINID', ARGV[2])

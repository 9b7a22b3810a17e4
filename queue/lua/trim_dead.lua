-- trim_dead.lua: deletes the dead letters below a threshold id and releases their job
-- indexes (queue.TrimDead, one batch).
--
--   KEYS[1]  the dead-letter stream
--   KEYS[2:] the job indexes of dead letters below the threshold (those with a valid
--            job id)
--   ARGV[1]  the threshold: XTRIM MINID deletes every entry with a lower id
--   ARGV[2]  index TTL in milliseconds
--   ARGV[3:] for each job index KEYS[i], in order, the id of its job's dead letter
--            below the threshold (ARGV[i + 1])
--
-- Returns the number of entries deleted.
--
-- Invariant: as for purge.lua, an index that pointed at a deleted dead letter stops
-- pointing at it and gets the TTL back, in the same step as the XTRIM, so no index keeps
-- saying failed for ever about a dead letter that no longer exists. An index that
-- meanwhile points elsewhere (the job was enqueued again, or failed again) is left
-- alone.
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'dead_id') == ARGV[i + 1] then
    redis.call('HDEL', KEYS[i], 'dead_id')
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  end
end
return redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1])

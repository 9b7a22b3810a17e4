-- purge.lua: deletes a dead letter (queue.Purge).
--
--   KEYS[1]  the dead-letter stream
--   KEYS[2]  (optional) the job index, left out when the record has no valid job id
--   ARGV[1]  dead-letter entry id
--   ARGV[2]  index TTL in milliseconds
--   ARGV[3]  the time, Unix milliseconds, for the job's history
--
-- Returns 1 when deleted, 0 when it did not exist.
--
-- Invariant: an index that pointed at the deleted entry stops pointing at it and gets a
-- TTL back, so it does not outlive it by more than ARGV[2]; the job stays failed until
-- then.
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
if KEYS[2] then
  history(KEYS[2], cjson.encode({outcome = 'purged', dead = ARGV[1], ['end'] = tonumber(ARGV[3])}))
  if redis.call('HGET', KEYS[2], 'dead_id') == ARGV[1] then
    redis.call('HDEL', KEYS[2], 'dead_id')
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
  end
end
return 1

-- register_partitions.lua: raises the recorded partitions of a queue to ARGV[2] if they
-- are fewer (queue.RegisterPartitions).
--
--   KEYS[1]  the partitions hash of the prefix (PartitionsKey(prefix))
--   ARGV[1]  the queue
--   ARGV[2]  its configured partitions
--
-- Returns the larger of the recorded and the configured count.
--
-- Invariant: the record only ever rises (the Workers of a process started with fewer
-- partitions still consume the higher ones), and a count of 1 is not written: a queue
-- that was never partitioned has no record.
local n = tonumber(ARGV[2])
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
if cur < n and n > 1 then
  redis.call('HSET', KEYS[1], ARGV[1], n)
end
return math.max(cur, n)

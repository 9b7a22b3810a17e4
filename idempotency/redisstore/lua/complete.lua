#!lua
-- complete.lua: replaces the caller's in-progress marker with the final record
-- (Store.Complete).
--
--   KEYS[1]  the record key
--   ARGV[1]  the caller's in-progress marker (exact value)
--   ARGV[2]  the final record
--   ARGV[3]  the result TTL in milliseconds
--
-- Returns 1 when replaced, 0 when the key no longer holds the marker.
--
-- Invariant: only the request holding the marker writes a result, so a request that
-- overran its lock TTL cannot overwrite the result of a newer request that took the key
-- after the marker expired.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0

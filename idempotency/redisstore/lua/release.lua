#!lua
-- release.lua: deletes the caller's in-progress marker (Store.Release, and the cleanup
-- of a claim whose SET may have been applied).
--
--   KEYS[1]  the record key
--   ARGV[1]  the caller's in-progress marker (exact value)
--
-- Returns 1 when deleted, 0 when the key no longer holds the marker.
--
-- Invariant: a request only ever deletes its own marker, never a newer request's marker
-- or a stored result.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0

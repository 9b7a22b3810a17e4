-- enqueue_stream.lua: enqueue_stream(keys, argv), the write of Store.Accept for a stream
-- that no package owns: XADD to the stream and, optionally, HSET (and PEXPIRE) one hash
-- in its slot. Accept runs it in accept.lua's slot.
--
--   KEYS[1]  the stream (Enqueue.Stream)
--   KEYS[2]  (optional) the index hash (Enqueue.IndexKey)
--   ARGV[1]  the index TTL in milliseconds (0: no expiry)
--   ARGV[2]  n, the number of stream field/value arguments that follow
--   ARGV[3:] the n stream fields and values, then the index's
--
-- Returns the new entry id.
--
-- Invariant: it raises every error (a key of another type: WRONGTYPE) before its first
-- write, so the accept that runs it writes all or nothing.
local function enqueue_stream(keys, argv)
  local t = redis.call('TYPE', keys[1]).ok
  if t ~= 'stream' and t ~= 'none' then error({err = 'WRONGTYPE stream key holds a ' .. t}) end
  if keys[2] then
    t = redis.call('TYPE', keys[2]).ok
    if t ~= 'hash' and t ~= 'none' then error({err = 'WRONGTYPE index key holds a ' .. t}) end
  end
  local n = tonumber(argv[2])
  local id = redis.call('XADD', keys[1], '*', unpack(argv, 3, 2 + n))
  if keys[2] then
    redis.call('HSET', keys[2], unpack(argv, 3 + n, #argv))
    if tonumber(argv[1]) > 0 then redis.call('PEXPIRE', keys[2], argv[1]) end
  end
  return id
end

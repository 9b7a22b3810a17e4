-- sweep_successes.lua: deletes, from one HSCAN page of the successes hash, the records
-- of entries no longer in the stream (older than its first entry, or any when it is
-- empty): those the trim could not move, because the entry was acknowledged by a run
-- that had lost its lease after another run's acknowledgement and the trim, or deleted
-- by someone's XDEL. queue.Trim runs it over the whole hash first.
--
--   KEYS[1]  the stream
--   KEYS[2]  the successes hash
--   ARGV[1]  the HSCAN cursor
--
-- Returns the next cursor ("0" when the scan is complete).
--
-- Invariant: the successes hash, which has no TTL, does not keep records the trim can
-- never move; a record of an entry still in the stream is never deleted.
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local fms, fseq
if #first > 0 then fms, fseq = parse(first[1][1]) end
local r = redis.call('HSCAN', KEYS[2], ARGV[1], 'COUNT', 500)
local kv, del = r[2], {}
for i = 1, #kv, 2 do
  local ms, seq = parse(kv[i])
  if ms == nil or fms == nil or ms < fms or (ms == fms and seq < fseq) then del[#del + 1] = kv[i] end
end
if #del > 0 then redis.call('HDEL', KEYS[2], unpack(del)) end
return r[1]

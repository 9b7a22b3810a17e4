-- history.lua: history(key, rec) appends rec, one event of a job's history, to the job
-- index at key (its "history" field, one "<seq> <JSON>" line per event, seq counting
-- in "history_n"), when that index exists, dropping the oldest events past 8192 bytes
-- (queue's historyMax). The scripts that settle a delivery, replay or purge a dead
-- letter include it and call it in the same step as their writes.
--
--   KEYS     none: key, the job index, is one of the calling script's KEYS
--   ARGV     none: rec, the event (a JSON object on one line, "" for none), is a
--            parameter
--
-- Returns nothing.
--
-- Invariant: an index never comes into being, or loses its TTL, for its history; and
-- the history stays bounded (a single event longer than the bound is kept alone).
local function history(key, rec)
  if rec == '' or redis.call('EXISTS', key) == 0 then return end
  local n = redis.call('HINCRBY', key, 'history_n', 1)
  local h = redis.call('HGET', key, 'history')
  local line = n .. ' ' .. rec
  if h then h = h .. '\n' .. line else h = line end
  if #h > 8192 then
    local cut = string.find(h, '\n', #h - 8192, true)
    if cut then h = string.sub(h, cut + 1) else h = line end
  end
  redis.call('HSET', key, 'history', h)
end

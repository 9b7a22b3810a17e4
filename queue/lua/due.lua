-- due.lua: lists the scheduled jobs that are due, by Redis' clock (queue.MoveDue, before
-- move.lua).
--
--   KEYS[1]  the scheduled set
--   ARGV[1]  the most members to return
--
-- Returns {now ms, {members due}, score of the earliest member or false}.
--
-- Invariant: it writes nothing; "due" is decided by Redis' clock, the one move.lua
-- checks again, so workers' clocks do not matter.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, ARGV[1])
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {now, due, first[2] or false}

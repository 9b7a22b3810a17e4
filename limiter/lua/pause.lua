-- pause.lua: stops calls to a model for the whole fleet until a time, and tells every
-- process at once (PUBLISH on Keys.Events). A pause for a refusal marks the model
-- recovering ("rec", the pause's end): after the pause, admit.lua lets one probe go at
-- a time until one answers (settle.lua ends the recovery). A pause for a window the
-- answers said was empty does not: its reset is known, and the buckets pace the calls
-- after it.
--
--   KEYS[1]  Keys.Model
--   ARGV[1]  the pause, ms from Redis' now
--   ARGV[2]  why
--   ARGV[3]  the events channel
--   ARGV[4]  the model's name in the event
--   ARGV[5]  1: a refusal (a 429, an exhausted quota): one probe goes first after it
--
-- Returns the pause's end in Unix ms (the one in force).
--
-- Invariant: a pause only ever lengthens: a shorter one than the pause in force changes
-- nothing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local till = now + tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[1], 'pause')) or 0
if till <= cur then return cur end
redis.call('HSET', KEYS[1], 'pause', till, 'why', ARGV[2])
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'rec', till)
  redis.call('HDEL', KEYS[1], 'probe')
end
redis.call('PUBLISH', ARGV[3], 'pause ' .. till .. ' ' .. ARGV[4])
return till

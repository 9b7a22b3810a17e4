-- schedule.lua: settles a pending entry whose run did not finish it: it is re-added to
-- the stream (due now) or put in the scheduled set, with the attempts it spent added to
-- its "attempts" field, and acknowledged, in one step (the worker's retry, snooze,
-- hand-back and wait).
--
--   KEYS[1]  the stream
--   KEYS[2]  the scheduled set
--   KEYS[3]  the scheduled entries
--   KEYS[4]  the job index
--   ARGV[1]  consumer group
--   ARGV[2]  consumer that must own the entry
--   ARGV[3]  entry id
--   ARGV[4]  attempts this settlement spends (runs that failed or never reported)
--   ARGV[5]  the budget: when the entry's attempts + ARGV[4] reach it, nothing is
--            written and the reply is {'exhausted', n}; 0 for none
--   ARGV[6]  the failure's error for the index's last_error, "" for none
--   ARGV[7]  job id
--   ARGV[8]  explicit delay in milliseconds, or -1 to take it from ARGV[11:]
--   ARGV[9]  what the job waits for (a limiter's reason, a signal), kept in the index's
--            "waiting" field while it is scheduled; "" for none. With a wake mark in the
--            index (wake.lua), the job is due now instead, and the mark is cleared
--   ARGV[10] the delivery's history event (historyRecord), appended to the index's
--            history with "wait" (the delay, ms) when the settlement lands; "" for none
--   ARGV[11] the delay in milliseconds after a first failure (the retry policy's
--            full-jitter draw), then
--   ARGV[12:] those after each further attempt spent; past the end, the last
--
-- Returns false when the entry is no longer pending to ARGV[2] (acknowledged, or
-- reclaimed by another consumer whose run now decides); {'exhausted', n}; {'gone'} when
-- the entry was deleted from the stream (it is acknowledged); else {id} with the new
-- entry id, or {'scheduled', delay}. The job index follows the job (state queued and
-- the new entry, or state scheduled with run_at and the member) when it pointed at this
-- entry.
--
-- Invariant: the job is in exactly one of the stream (this entry pending, or the new
-- one) and the scheduled set after the script, whatever happens around it.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #p == 0 then return false end
local e = redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3])
if #e == 0 then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  return {'gone'}
end
local fields = e[1][2]
local spent, at_pos = 0, nil
for i = 1, #fields - 1, 2 do
  if fields[i] == 'attempts' then spent, at_pos = tonumber(fields[i + 1]) or 0, i + 1 end
end
local add = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
if budget > 0 and spent + add >= budget then return {'exhausted', spent + add} end
if add > 0 then
  if at_pos then
    fields[at_pos] = tostring(spent + add)
  else
    fields[#fields + 1] = 'attempts'
    fields[#fields + 1] = tostring(spent + add)
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
local delay = tonumber(ARGV[8])
if delay < 0 then
  local i = 11 + spent
  if i > #ARGV then i = #ARGV end
  delay = tonumber(ARGV[i]) or 0
end
local current = redis.call('HGET', KEYS[4], 'entry') == ARGV[3]
-- A wake (wake.lua) arrived while the job ran: what it waited for is there, so the job
-- runs again now instead of after its wait.
if current and ARGV[9] ~= '' and redis.call('HGET', KEYS[4], 'wake') then
  delay = 0
end
if current then redis.call('HDEL', KEYS[4], 'wake') end
local result
if delay <= 0 then
  local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
  if current then
    redis.call('HSET', KEYS[4], 'state', 'queued', 'entry', id)
    redis.call('HDEL', KEYS[4], 'waiting')
  end
  result = {id}
else
  local t = redis.call('TIME')
  local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + delay
  local member = ARGV[7] .. ' ' .. ARGV[3]
  redis.call('ZADD', KEYS[2], at, member)
  redis.call('HSET', KEYS[3], member, cjson.encode(fields))
  if current then
    redis.call('HSET', KEYS[4], 'state', 'scheduled', 'run_at', at, 'scheduled', member)
    if ARGV[9] ~= '' then
      redis.call('HSET', KEYS[4], 'waiting', ARGV[9])
      redis.call('HDEL', KEYS[4], 'entry')
    else
      redis.call('HDEL', KEYS[4], 'entry', 'waiting')
    end
    redis.call('PERSIST', KEYS[4])
  end
  result = {'scheduled', delay}
end
if ARGV[6] ~= '' and redis.call('EXISTS', KEYS[4]) == 1 then redis.call('HSET', KEYS[4], 'last_error', ARGV[6]) end
if ARGV[10] ~= '' then
  local wait = 0
  if delay > 0 then wait = delay end
  history(KEYS[4], string.sub(ARGV[10], 1, -2) .. ',"wait":' .. wait .. '}')
end
return result

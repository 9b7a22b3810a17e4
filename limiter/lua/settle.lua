-- settle.lua: ends a permit (Permit.Done, and the release of an admission whose reply
-- was lost): it gives back its concurrency, corrects the tokens it reserved to what the
-- call cost, learns the provider's limits and remainders from its answer's headers, and
-- charges the tenant's budget. It is safe to run for a permit that was never admitted
-- through Redis (every removal is a no-op) and for one whose lease ended (its budget
-- reservation was then charged whole and marked "x:<permit>"; the charge is corrected,
-- once).
--
--   KEYS[1]  Keys.Model
--   KEYS[2]  Keys.InFlight
--   KEYS[3]  Keys.TenantInFlight
--   KEYS[4]  Keys.Budget
--   KEYS[5]  Keys.Held
--   KEYS[6]  Keys.Released(permit)
--   ARGV[1]  permit id
--   ARGV[2]  1 when the request was sent (its request counts), 0 when it never left
--   ARGV[3]  tokens the admission took from the token bucket (0: none)
--   ARGV[4]  tokens the call cost (its usage; the reservation when it is unknown)
--   ARGV[5]  tokens the admission reserved from the budget (0: no budget)
--   ARGV[6]  requests per minute configured (0: learnt)
--   ARGV[7]  tokens per minute configured (0: learnt)
--   ARGV[8]  requests the provider says remain (-1: it did not say)
--   ARGV[9]  tokens the provider says remain (-1)
--   ARGV[10] the call's duration, ms (-1: none, it was not sent)
--   ARGV[11] requests per minute the provider says (0: it did not say)
--   ARGV[12] tokens per minute the provider says (0)
--   ARGV[13] how long a learnt limit holds without the provider saying it again, ms
--   ARGV[14] the pause this call probed ("" none: see admit.lua)
--   ARGV[15] 1 when the provider answered (anything but a 429, an exhausted quota or
--            no answer): the probe ends the recovery; 0: the next probe may go now
--   ARGV[16] for the release of an admission whose reply was lost, the lease, ms: a
--            mark (KEYS[6]) that long makes the admission a no-op if it comes later;
--            0 otherwise
--   ARGV[17] the events channel
--   ARGV[18] the model's name: a probe's answer that ends the recovery is announced on
--            the events channel ("resume <model>"), so the calls waiting for it go at
--            once
--
-- Returns {rpm, tpm, learnt at} in force after it (learnt when not configured, and only
-- while the provider said them within ARGV[13]; learnt at in Unix ms, 0 for never).
--
-- Invariant: its budget part is idempotent: run again (a retry after a reply lost to a
-- timeout), it finds neither the hold nor the mark and changes nothing. Its token
-- bucket part is not: a second run corrects the bucket again, by at most the call's
-- reservation, within the bucket's one minute (a documented bound).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
if tonumber(ARGV[16]) > 0 then redis.call('SET', KEYS[6], '1', 'PX', ARGV[16]) end
redis.call('ZREM', KEYS[2], id)
redis.call('ZREM', KEYS[3], id)
local bres = tonumber(ARGV[5])
local cost = tonumber(ARGV[4])
if bres > 0 then
  if redis.call('ZREM', KEYS[5], id) == 1 then
    redis.call('HINCRBY', KEYS[4], 'reserved', -bres)
    redis.call('HINCRBY', KEYS[4], 'used', cost)
    redis.call('HDEL', KEYS[4], 'p:' .. id)
  else
    local x = tonumber(redis.call('HGET', KEYS[4], 'x:' .. id))
    if x then
      redis.call('HINCRBY', KEYS[4], 'used', cost - x)
      redis.call('HDEL', KEYS[4], 'x:' .. id)
    end
  end
end
if ARGV[15] == '1' then redis.call('HSET', KEYS[1], 'seen', now) end
if ARGV[14] ~= '' and redis.call('HGET', KEYS[1], 'rec') == ARGV[14] then
  if ARGV[15] == '1' then
    redis.call('HDEL', KEYS[1], 'rec', 'probe')
    redis.call('PUBLISH', ARGV[17], 'resume ' .. ARGV[18])
  else redis.call('HDEL', KEYS[1], 'probe') end
end
local lrpm, ltpm = tonumber(ARGV[11]), tonumber(ARGV[12])
if lrpm > 0 then redis.call('HSET', KEYS[1], 'lrpm', lrpm) end
if ltpm > 0 then redis.call('HSET', KEYS[1], 'ltpm', ltpm) end
if lrpm > 0 or ltpm > 0 then redis.call('HSET', KEYS[1], 'lts', now) end
local st = redis.call('HMGET', KEYS[1], 'rt', 'rts', 'tt', 'tts', 'dur', 'lrpm', 'ltpm', 'avgtok', 'lts')
local lts = tonumber(st[9]) or 0
local fresh = now - lts < tonumber(ARGV[13])
local rpm = tonumber(ARGV[6]); if rpm <= 0 then rpm = fresh and tonumber(st[6]) or 0 end
local tpm = tonumber(ARGV[7]); if tpm <= 0 then tpm = fresh and tonumber(st[7]) or 0 end
local function refill(tok, ts, cap)
  if not tok then return cap end
  local r = tok + (now - (ts or now)) * cap / 60000
  if r > cap then return cap end
  return r
end
if rpm > 0 then
  local rt = refill(tonumber(st[1]), tonumber(st[2]), rpm)
  if ARGV[2] == '0' then rt = math.min(rt + 1, rpm) end
  local left = tonumber(ARGV[8])
  if left >= 0 and left < rt then rt = left end
  redis.call('HSET', KEYS[1], 'rt', tostring(rt), 'rts', now)
end
if tpm > 0 then
  local tt = refill(tonumber(st[3]), tonumber(st[4]), tpm)
  tt = tt + tonumber(ARGV[3]) - cost
  if tt > tpm then tt = tpm end
  if tt < -tpm then tt = -tpm end
  local left = tonumber(ARGV[9])
  if left >= 0 and left < tt then tt = left end
  redis.call('HSET', KEYS[1], 'tt', tostring(tt), 'tts', now)
end
local d = tonumber(ARGV[10])
if d >= 0 then
  local old = tonumber(st[5])
  if old then d = old * 0.8 + d * 0.2 end
  redis.call('HSET', KEYS[1], 'dur', tostring(d))
  if cost > 0 then
    local avg = tonumber(st[8])
    if avg then avg = avg * 0.8 + cost * 0.2 else avg = cost end
    redis.call('HSET', KEYS[1], 'avgtok', tostring(avg))
  end
end
return {rpm, tpm, lts}

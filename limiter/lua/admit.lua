-- admit.lua: decides whether one call may go now (Limiter.Acquire). It is the only
-- writer of a permit's admission, and every check and every reservation it makes is one
-- atomic step.
--
--   KEYS[1]  Keys.Model
--   KEYS[2]  Keys.InFlight
--   KEYS[3]  Keys.Lines
--   KEYS[4]  Keys.Places
--   KEYS[5]  Keys.TenantInFlight
--   KEYS[6]  Keys.Budget
--   KEYS[7]  Keys.Held
--   KEYS[8]  Keys.Released(permit)
--   ARGV[1]  permit id
--   ARGV[2]  tenant
--   ARGV[3]  the call's work key ("" none: it never holds a place)
--   ARGV[4]  requests per minute configured (0: the learnt one, if any)
--   ARGV[5]  tokens per minute configured (0: the learnt one, if any)
--   ARGV[6]  calls in flight (0: none)
--   ARGV[7]  the tenant's calls in flight (0: none)
--   ARGV[8]  tokens the call needs (estimate plus output)
--   ARGV[9]  the tenant's tokens per day (0: no budget)
--   ARGV[10] permit lease, ms
--   ARGV[11] the end of the budget's day, Unix ms
--   ARGV[12] the budget keys' TTL, s
--   ARGV[13] usage half-life, ms
--   ARGV[14] how long a tenant counts as waiting after its place, ms
--   ARGV[15] how long a place is held after it is due, ms
--   ARGV[16] a call's duration until one was measured, ms
--   ARGV[17] a call's cost in tokens until one was measured: its prompt's estimate
--            (too low a guess makes lines a little too dense until the first answer
--            settles; the output's whole reservation would leave capacity idle)
--   ARGV[18] how long a learnt limit holds without the provider saying it again, ms
--   ARGV[19] after a pause, how long a probe goes alone before another may go, ms
--   ARGV[20] for a background call (a shadow: only capacity nobody else needs), the
--            share of each shared limit it must leave free, 0 to 1; "0" for a call of
--            its own class
--
-- Returns {1, tokens, probe} when admitted (the tokens it took from the token bucket;
-- probe: the pause ("rec") this call probes, "" when none), else {0, wait ms, reason,
-- detail}: reason "paused" (detail: why), "recovering" (a probe is out: wait for its
-- answer, announced as "resume <model>" on the events channel, or the wait), "budget"
-- (the call does not fit in what is left of today's budget; detail: tokens used and
-- reserved today), "budget reserved" (it would fit, but calls in flight hold the rest:
-- a wait of about a call), "tenant concurrency", or, for the shared capacity, "requests
-- per minute", "tokens per minute", "concurrency" or "fair share" (another waiting
-- tenant has had less lately), for a background call "others first" (another tenant
-- waits for capacity) or "headroom" (it would leave less than its share of a limit
-- free), or "released" (the caller gave up on this admission). A call denied shared capacity is given a place in its tenant's line: its wait ends
-- at that place, so that a backlog of calls put off together comes back spread out
-- rather than all at once, and when it comes back (with the same work key) a denial
-- puts it back near the front (one spacing per waiting tenant ahead), not behind its
-- tenant's later calls. A line advances by the spacing of one call (the tightest of
-- 1/rpm, the average call's tokens/tpm and duration/concurrency) times the tenants
-- whose lines reach past the place given: the backlogs of the tenants that have one
-- interleave, round robin, at the capacity's pace, and where a line ends the others
-- speed up. Where calls still meet (a tenant arriving after another's backlog was
-- placed), a tenant that has had more lately yields to a waiting tenant that has had
-- less (the fair share). A place is a hint, not a reservation: capacity goes to
-- whoever asks first, but for that yield, so none is left idle for a share nobody
-- uses.
--
-- Invariant: two processes can never both take the last request of a minute or the
-- last tokens of a budget, and an admission that arrives after its caller released it
-- admits nothing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, tenant, work = ARGV[1], ARGV[2], ARGV[3]
-- An admission that arrives after its caller gave up on it and released it (its
-- reply was lost, and it was delayed behind the release) admits nothing.
if redis.call('EXISTS', KEYS[8]) == 1 then return {0, 1, 'released', ''} end
local need = tonumber(ARGV[8])
local st = redis.call('HMGET', KEYS[1], 'rt', 'rts', 'tt', 'tts', 'pause', 'why', 'dur', 'lrpm', 'ltpm', 'avgtok', 'lts', 'rec', 'probe', 'seen')
local fresh = now - (tonumber(st[11]) or 0) < tonumber(ARGV[18])
local rpm = tonumber(ARGV[4]); if rpm <= 0 then rpm = fresh and tonumber(st[8]) or 0 end
local tpm = tonumber(ARGV[5]); if tpm <= 0 then tpm = fresh and tonumber(st[9]) or 0 end
local conc, tconc = tonumber(ARGV[6]), tonumber(ARGV[7])
local lease = tonumber(ARGV[10])
local dur = tonumber(st[7]) or tonumber(ARGV[16])
local pause = tonumber(st[5]) or 0
if pause > now then return {0, pause - now, 'paused', st[6] or ''} end
-- After a pause, one call at a time goes first (a probe, one every ARGV[19] ms while
-- none has answered): the calls that waited for the pause do not all go at once into
-- a limit that may not have come back.
local rec = st[12]
if not rec and rpm <= 0 and tpm <= 0 and conc <= 0 and tconc <= 0 and tonumber(ARGV[9]) <= 0
    and now - (tonumber(st[14]) or 0) >= tonumber(ARGV[18]) then
  -- First contact: nothing configured (no limit, budget or tenant cap), nothing learnt
  -- and no answer lately. The first call goes alone (a probe): its answer's headers
  -- teach the limits before the others go, rather than a whole fleet's worker slots
  -- meeting the limit at once.
  rec = 'first'
  redis.call('HSET', KEYS[1], 'rec', rec)
end
if rec then
  local probe = tonumber(st[13]) or 0
  if probe > now then return {0, probe - now, 'recovering', ''} end
end

local budget = tonumber(ARGV[9])
if budget > 0 then
  for _, p in ipairs(redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)) do
    local n = tonumber(redis.call('HGET', KEYS[6], 'p:' .. p)) or 0
    redis.call('HINCRBY', KEYS[6], 'reserved', -n)
    redis.call('HINCRBY', KEYS[6], 'used', n)
    redis.call('HDEL', KEYS[6], 'p:' .. p)
    redis.call('HSET', KEYS[6], 'x:' .. p, n)
    redis.call('ZREM', KEYS[7], p)
  end
  local b = redis.call('HMGET', KEYS[6], 'used', 'reserved')
  local used = tonumber(b[1]) or 0
  local spent = used + (tonumber(b[2]) or 0)
  if spent + need > budget then
    if used + need > budget then
      return {0, math.max(tonumber(ARGV[11]) - now, 1), 'budget', tostring(spent)}
    end
    -- What is missing is held by calls in flight: they settle (usually below their
    -- reservation) within about a call's duration, or their leases end.
    local w = dur
    local first = redis.call('ZRANGE', KEYS[7], 0, 0, 'WITHSCORES')
    if first[2] then w = math.min(w, tonumber(first[2]) - now) end
    return {0, math.max(math.floor(w), 1), 'budget reserved', tostring(spent)}
  end
end
if tconc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  if redis.call('ZCARD', KEYS[5]) >= tconc then
    return {0, math.max(math.floor(dur / tconc), 1), 'tenant concurrency', ''}
  end
end

local shared = rpm > 0 or tpm > 0 or conc > 0
local rt, tt = 0, 0
local tneed = need
if shared then
  local function refill(tok, ts, cap)
    if not tok then return cap end
    local r = tok + (now - (ts or now)) * cap / 60000
    if r > cap then return cap end
    return r
  end
  if rpm > 0 then rt = refill(tonumber(st[1]), tonumber(st[2]), rpm) end
  if tpm > 0 then
    tt = refill(tonumber(st[3]), tonumber(st[4]), tpm)
    if tneed > tpm then tneed = tpm end
  end
  if conc > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)

  local line, mark, use = {}, {}, {}
  local fair_ret
  local fair = redis.call('HGETALL', KEYS[3])
  for i = 1, #fair, 2 do
    local k, v = fair[i], fair[i + 1]
    local kind, who = string.sub(k, 1, 1), string.sub(k, 3)
    if k == 'ret' then fair_ret = v
    elseif kind == 'n' then line[who] = tonumber(v)
    elseif kind == 'w' then mark[who] = tonumber(v)
    elseif kind == 'u' then use[who] = v end
  end
  local half = tonumber(ARGV[13])
  local function usage(who)
    local v = use[who]
    if not v then return 0 end
    local sep = string.find(v, '|', 1, true)
    if not sep then return 0 end
    local u, ts = tonumber(string.sub(v, 1, sep - 1)) or 0, tonumber(string.sub(v, sep + 1)) or now
    return u * math.pow(2, -(now - ts) / half)
  end
  -- Forget tenants with nothing recent: no place ahead, not waiting, no usage left.
  local seen = {}
  for who in pairs(line) do seen[who] = true end
  for who in pairs(mark) do seen[who] = true end
  for who in pairs(use) do seen[who] = true end
  for who in pairs(seen) do
    if who ~= tenant and (line[who] or 0) < now and (mark[who] or 0) < now and usage(who) < 0.01 then
      redis.call('HDEL', KEYS[3], 'n:' .. who, 'w:' .. who, 'u:' .. who)
      line[who], mark[who], use[who] = nil, nil, nil
    end
  end

  local held = false
  if work ~= '' and redis.call('ZSCORE', KEYS[4], work) then held = true end
  local wait, why = 0, nil
  if conc > 0 and redis.call('ZCARD', KEYS[2]) >= conc then wait, why = dur / conc, 'concurrency' end
  if rpm > 0 and rt < 1 then
    local w = (1 - rt) * 60000 / rpm
    if not why or w > wait then wait, why = w, 'requests per minute' end
  end
  if tpm > 0 and tt < tneed then
    local w = (tneed - tt) * 60000 / tpm
    if not why or w > wait then wait, why = w, 'tokens per minute' end
  end
  if not why then
    local mine = usage(tenant)
    for who, til in pairs(mark) do
      if who ~= tenant and til > now and usage(who) + 1 <= mine then
        why = 'fair share'
        break
      end
    end
  end
  -- A background call takes only what nobody else needs: it yields to any other
  -- tenant waiting for capacity, and leaves a share of each limit free for the calls
  -- to come. It takes no place in a line (lines are for calls of their own class).
  local free = tonumber(ARGV[20]) or 0
  if free > 0 then
    local bw, bwhy = 0, why
    if not bwhy then
      for who, til in pairs(mark) do
        if who ~= tenant and til > now then bw, bwhy = dur, 'others first'; break end
      end
    end
    if not bwhy and conc > 0 and redis.call('ZCARD', KEYS[2]) + 1 > conc * (1 - free) then bw, bwhy = dur / conc, 'headroom' end
    if not bwhy and rpm > 0 and rt - 1 < rpm * free then bw, bwhy = (1 + rpm * free - rt) * 60000 / rpm, 'headroom' end
    if not bwhy and tpm > 0 and tt - tneed < tpm * free then bw, bwhy = (tneed + tpm * free - tt) * 60000 / tpm, 'headroom' end
    if bwhy then return {0, math.max(math.ceil(math.max(bw, wait)), 1), bwhy, ''} end
  end
  if why then
    local sp = 0
    if rpm > 0 then sp = 60000 / rpm end
    if tpm > 0 then sp = math.max(sp, math.min(tneed, tonumber(st[10]) or tonumber(ARGV[17])) * 60000 / tpm) end
    if conc > 0 then sp = math.max(sp, dur / conc) end
    local place
    if held and why ~= 'fair share' then
      -- Back at its place and the capacity taken (by calls that came back late, or a
      -- moment too early): it is not sent behind its tenant's backlog, but joins the
      -- model's line of returns, one spacing apart, so that calls back at once do not
      -- all ask again for the next unit (a crowd polling the bucket).
      place = math.max(now + wait, tonumber(fair_ret) or 0)
      redis.call('HSET', KEYS[3], 'ret', tostring(place + sp))
    elseif held then
      -- It yields to a waiting tenant that has had less: after one spacing per such
      -- tenant.
      local waiting = 1
      for who, til in pairs(mark) do
        if who ~= tenant and til > now then waiting = waiting + 1 end
      end
      place = now + math.max(wait, sp * waiting)
    else
      place = math.max(now + wait, line[tenant] or 0)
      -- Round robin: the line advances by one spacing for each tenant whose own line
      -- reaches past this place, so the lines of the tenants with a backlog there
      -- interleave at the capacity's pace (and a short line ahead does not slow a
      -- long one beyond its end).
      local sharing = 1
      for who, nxt in pairs(line) do
        if who ~= tenant and nxt > place then sharing = sharing + 1 end
      end
      redis.call('HSET', KEYS[3], 'n:' .. tenant, tostring(place + sp * sharing))
    end
    redis.call('HSET', KEYS[3], 'w:' .. tenant, tostring(place + tonumber(ARGV[14])))
    if work ~= '' then redis.call('ZADD', KEYS[4], place + tonumber(ARGV[15]), work) end
    return {0, math.max(math.ceil(place - now), 1), why, ''}
  end

  if rpm > 0 then rt = rt - 1 end
  if tpm > 0 then tt = tt - tneed end
  if rpm > 0 then redis.call('HSET', KEYS[1], 'rt', tostring(rt), 'rts', now) end
  if tpm > 0 then redis.call('HSET', KEYS[1], 'tt', tostring(tt), 'tts', now) end
  if conc > 0 then redis.call('ZADD', KEYS[2], now + lease, id) end
  redis.call('HSET', KEYS[3], 'u:' .. tenant, tostring(usage(tenant) + 1) .. '|' .. now)
  if held then redis.call('ZREM', KEYS[4], work) end
end

if tconc > 0 then redis.call('ZADD', KEYS[5], now + lease, id) end
if budget > 0 then
  redis.call('HINCRBY', KEYS[6], 'reserved', need)
  redis.call('HSET', KEYS[6], 'p:' .. id, need)
  redis.call('ZADD', KEYS[7], now + lease, id)
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[12]))
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[12]))
end
if rec then redis.call('HSET', KEYS[1], 'probe', now + tonumber(ARGV[19])) end
if tpm > 0 then return {1, tneed, rec or ''} end
return {1, 0, rec or ''}

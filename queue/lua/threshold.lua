-- threshold.lua: finds how far the stream can be trimmed (queue.Trim).
--
--   KEYS[1]  the stream
--   ARGV     none
--
-- Returns the lowest entry id any consumer group still needs (its oldest pending entry,
-- or the entry after its last delivered one), or "" when there is no stream or no group.
--
-- Invariant: every entry below the threshold has been acknowledged by every group (it
-- reads every group's state in one step), so a trim to it never removes an entry that is
-- pending or not yet delivered to some group.
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return '' end
local best_ms, best_seq
local function consider(ms, seq)
  if best_ms == nil or ms < best_ms or (ms == best_ms and seq < best_seq) then
    best_ms, best_seq = ms, seq
  end
end
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['pending'] > 0 then
    local summary = redis.call('XPENDING', KEYS[1], info['name'])
    local ms, seq = string.match(summary[2], '^(%d+)-(%d+)$')
    consider(tonumber(ms), tonumber(seq))
  else
    local ms, seq = string.match(info['last-delivered-id'], '^(%d+)-(%d+)$')
    consider(tonumber(ms), tonumber(seq) + 1)
  end
end
return string.format('%d-%d', best_ms, best_seq)

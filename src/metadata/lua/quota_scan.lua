-- quota_scan.lua: one step of a pass over the cell's objects that charges each to the quota
-- that governs it now (prelude, "Quotas"): after a quota was added, or removed from under a
-- shorter one. Objects published meanwhile are charged by their commit; a step never charges
-- an object twice (its record names its quota).
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     cursor ('0' starts a pass), the gen of the quota whose count this pass completes
--          ('' none)
-- Returns  the next cursor ('0': the pass is done), objects looked at, objects whose charge
--          moved
--
-- A step looks at about 256 objects (ZSCAN of the LRU order), whatever the cell's size.
-- Uses     call, quotas

local step = redis.call('ZSCAN', P .. ':lru', ARGV[1], 'COUNT', 256)
local items, moved = step[2], 0
for i = 1, #items, 2 do
  local key = items[i]
  local o = redis.call('HMGET', P .. ':obj:' .. key, 'quota', 'size')
  if o[2] then
    local q = quota_of(key)
    local has = o[1]
    if has and redis.call('EXISTS', P .. ':quota:' .. has) == 0 then has = nil end
    if (q and q[1]) ~= has then
      quota_uncharge(has, key, o[2])
      if q then
        quota_charge(q, key, o[2], tonumber(items[i + 1]))
      else
        redis.call('HDEL', P .. ':obj:' .. key, 'quota')
      end
      moved = moved + 1
    end
  end
end
if step[1] == '0' and ARGV[2] ~= '' and redis.call('EXISTS', P .. ':quota:' .. ARGV[2]) == 1 then
  redis.call('HDEL', P .. ':quota:' .. ARGV[2], 'counting')
end
return {step[1], tostring(#items / 2), tostring(moved)}

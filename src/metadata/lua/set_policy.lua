-- set_policy.lua: the cell's eviction policy (kvstash policy): which object a full pool gives up
-- first (prelude/policy.lua).
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     the policy ('lru', 'arc' or 'turn-ttl'), or '' to change nothing; turn-ttl's clock
--          rate (optional, 1: policy seconds per second of Redis time, for a replay that
--          compresses a trace's time)
-- Returns  the policy; ARC's state: objects in T1, T2, keys remembered in B1, B2, and p; turn-ttl's:
--          objects it orders, keys its ghosts remember, its clock rate (zeros where another
--          policy runs); INVALID for a policy kvstash does not know
--
-- A change drops the state of the policy left: under a new arc or turn-ttl, the objects stored
-- before it go first.
-- Uses     call, quotas, policy

local want = ARGV[1] or ''
if want ~= '' and not POLICIES[want] then
  return redis.error_reply('INVALID no eviction policy ' .. want .. ' (lru, arc or turn-ttl)')
end
local scale = tonumber(ARGV[2] or '1')
if not scale or scale <= 0 then return redis.error_reply('INVALID clock rate ' .. tostring(ARGV[2])) end
if want ~= '' and (want ~= policy() or (want == 'turn-ttl' and scale ~= (ttl().scale or 1))) then
  redis.call('UNLINK', ARC_T1, ARC_T2, ARC_B1, ARC_B2, ARC, TTL, TTL_DUE, TTL_GHOST, TTL_TRACK, TTL_TRACKED,
             TTL_PENDING, TTL_STATS)
  redis.call('HSET', P .. ':cell', 'policy', want)
  cell_settings().policy = want
  ttl_state = nil
  if want == 'turn-ttl' then redis.call('HSET', TTL, 'origin', fmt17(now_fine / 1000), 'scale', fmt17(scale)) end
end
local ttl_on = policy() == 'turn-ttl'
return {policy(), redis.call('ZCARD', ARC_T1), redis.call('ZCARD', ARC_T2), redis.call('ZCARD', ARC_B1),
        redis.call('ZCARD', ARC_B2), redis.call('HGET', ARC, 'p') or '0', redis.call('ZCARD', TTL_DUE),
        redis.call('ZCARD', TTL_GHOST), ttl_on and fmt17(ttl().scale or 1) or '0'}

-- set_policy.lua: the cell's eviction policy (kvstash policy): which object a full pool gives up
-- first (prelude.lua, "Eviction policy").
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     the policy ('lru' or 'arc'), or '' to change nothing
-- Returns  the policy, then ARC's state: objects in T1, T2, keys remembered in B1, B2, and p
--          (zeros under lru); INVALID for a policy kvstash does not know
--
-- A change drops ARC's lists: under a new arc, the objects stored before it go first.

local want = ARGV[1] or ''
if want ~= '' and not POLICIES[want] then
  return redis.error_reply('INVALID no eviction policy ' .. want .. ' (lru or arc)')
end
if want ~= '' and want ~= policy() then
  redis.call('UNLINK', ARC_T1, ARC_T2, ARC_B1, ARC_B2, ARC)
  redis.call('HSET', P .. ':cell', 'policy', want)
  policy_of_cell = want
end
return {policy(), redis.call('ZCARD', ARC_T1), redis.call('ZCARD', ARC_T2), redis.call('ZCARD', ARC_B1),
        redis.call('ZCARD', ARC_B2), redis.call('HGET', ARC, 'p') or '0'}

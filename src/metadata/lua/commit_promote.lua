-- commit_promote.lua: an object a node read back from its NVMe tier (and checked) lives in
-- its pool again.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch, key, token (the object's), put token (the promotion's), slots
-- Returns  OK; STALE when the object changed (replaced, removed, its slots no longer its own)
--          or the node or the promotion's lease is over: its pages are freed (the node's
--          reads into them are done)
-- Uses     call, nodes, pages, policy, reads

local id, epoch, key, token, ptoken, slots = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local pk = P .. ':put:' .. ptoken
local extents = redis.call('HGET', pk, 'extents')
if not extents then return redis.error_reply('STALE the promotion of ' .. key .. ' lost its lease') end
local ok = P .. ':obj:' .. key
local o = redis.call('HMGET', ok, 'token', 'tier', 'ssd_extents')
local deadline = tonumber(redis.call('ZSCORE', P .. ':pending', ptoken) or '0') or 0
local why = nil
if not serves(id, epoch) then
  why = 'STALE node ' .. id .. ' is not serving under this epoch'
elseif deadline < now then
  why = 'STALE the promotion of ' .. key .. ' passed its deadline'
elseif o[1] ~= token or o[2] ~= 'ssd' or o[3] ~= slots then
  why = 'STALE object ' .. key .. ' changed during its promotion'
elseif not current(extents) then
  why = 'STALE the pages of the promotion of ' .. key .. ' were freed'
end
if why then
  drop_put(ptoken, extents)
  if o[1] then
    redis.call('HDEL', ok, 'promoting')
    wake_waiters(key, o[1])
  end
  return redis.error_reply(why)
end
free_extents(slots)
redis.call('DEL', pk)
redis.call('ZREM', P .. ':pending', ptoken)
redis.call('HSET', ok, 'extents', extents)
redis.call('HDEL', ok, 'tier', 'ssd_extents', 'ssd_sum', 'promoting')
wake_waiters(key, token)
redis.call('ZREM', P .. ':lru_ssd:' .. id, key)
redis.call('SMOVE', P .. ':tier_objs:' .. id, P .. ':objs:' .. id, key)
mark_used({key})  -- a get asked for it
redis.call('HINCRBY', P .. ':stats', 'promoted', 1)
return 'OK'

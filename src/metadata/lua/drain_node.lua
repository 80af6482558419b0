-- drain_node.lua: the node is leaving (kvstashd stopping).
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch
-- Returns  how many objects were dropped; STALE when the epoch is not the registered one
--
-- It takes no new pages and its objects are dropped (unreadable at once, swept in
-- batches).
-- Uses     call, objects

local id = ARGV[1]
local nk = P .. ':node:' .. id
if redis.call('HGET', nk, 'epoch') ~= ARGV[2] then
  return redis.error_reply('STALE node ' .. id .. ' is not registered with this epoch')
end
redis.call('HSET', nk, 'state', 'leaving')
return sweep_node_objects(id)

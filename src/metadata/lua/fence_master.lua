-- fence_master.lua: a client or node that reached the cell's Redis through Sentinel says which
-- master it reached, before anything else on that connection. A new master (a failover) may
-- lack the newest allocations, leases and commits of the old one, so its pages and
-- generations cannot be trusted against what the nodes still serve: every node is declared
-- dead at once. None is placed on or read from again until it registers anew, which its next
-- heartbeat (refused) makes it do after fencing its whole pool and dropping its old pool key.
-- The objects on the nodes are lost (but for the recoverable keys on their NVMe tiers, which
-- the nodes offer again); no byte of theirs is ever returned as another's.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     the replication ID of the master this connection reached (INFO replication's
--          master_replid)
-- Returns  1 when the cell knew another master and its nodes were declared dead, else 0
-- Uses     call, tier

local seen = redis.call('GET', P .. ':master')
if seen == ARGV[1] then return 0 end
redis.call('SET', P .. ':master', ARGV[1])
if not seen then return 0 end
for _, id in ipairs(redis.call('ZRANGE', P .. ':nodes', 0, -1)) do
  redis.call('ZADD', P .. ':nodes', 0, id)
end
-- Nor can its records of the NVMe tiers: a put or remove that replaced an object on a tier may
-- be missing here, and the old bytes may still be in its slots. Each tier starts over when its
-- node registers again (register_node: the id no longer matches), and the node offers what
-- its device holds of the recoverable keys (recover_tier.lua), newest first.
for _, id in ipairs(redis.call('SMEMBERS', P .. ':known')) do
  local sk = P .. ':node:' .. slots_of(id)
  if redis.call('HEXISTS', sk, 'tier_id') == 1 then redis.call('HSET', sk, 'tier_id', 'distrusted') end
end
-- The events stream may lack what the old master appended since the replica last heard: the
-- relay sees a new epoch, tells routers all is cleared, and starts over from P:events:objs.
if redis.call('EXISTS', P .. ':events') == 1 then redis.call('HINCRBY', P .. ':events', 'epoch', 1) end
redis.call('HINCRBY', P .. ':stats', 'failovers', 1)
return 1

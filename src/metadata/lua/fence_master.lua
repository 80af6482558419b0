-- fence_master.lua: a client or node that reached the cell's Redis through Sentinel says which
-- master it reached, before anything else on that connection. A new master (a failover) may
-- lack the newest allocations, leases and commits of the old one, so its pages and
-- generations cannot be trusted against what the nodes still serve: every node is declared
-- dead at once. None is placed on or read from again until it registers anew, which its next
-- heartbeat (refused) makes it do after fencing its whole pool and dropping its old pool key.
-- The objects on the nodes are lost; no byte of theirs is ever returned as another's.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     the replication ID of the master this connection reached (INFO replication's
--          master_replid)
-- Returns  1 when the cell knew another master and its nodes were declared dead, else 0

local seen = redis.call('GET', P .. ':master')
if seen == ARGV[1] then return 0 end
redis.call('SET', P .. ':master', ARGV[1])
if not seen then return 0 end
for _, id in ipairs(redis.call('ZRANGE', P .. ':nodes', 0, -1)) do
  redis.call('ZADD', P .. ':nodes', 0, id)
end
redis.call('HINCRBY', P .. ':stats', 'failovers', 1)
return 1

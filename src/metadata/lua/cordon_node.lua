-- cordon_node.lua: an operator's drain.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id
-- Returns  the state before and the node's objects; NOT_FOUND for an unknown id
--
-- The node takes no new pages; its objects stay readable until they expire, are evicted or
-- removed.
-- Uses     call

local nk = P .. ':node:' .. ARGV[1]
local st = redis.call('HGET', nk, 'state')
if not st then return redis.error_reply('NOT_FOUND no node ' .. ARGV[1]) end
if st == 'up' then redis.call('HSET', nk, 'state', 'draining') end
return {st, redis.call('SCARD', P .. ':objs:' .. ARGV[1])}

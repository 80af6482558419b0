-- forget_node.lua: an operator removes what a dead node left.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id
-- Returns  how many objects went to the sweep; NOT_FOUND for an unknown id; IN_USE while its
--          heartbeat is current
--
-- Its objects (released), free list and generations, its place in the cell. The node's
-- record keeps its incarnation count, so a later node with this id still starts above every old
-- generation.
-- Uses     call, nodes, objects

local id = ARGV[1]
local nk = P .. ':node:' .. id
if redis.call('EXISTS', nk) == 0 then return redis.error_reply('NOT_FOUND no node ' .. id) end
if live(id) then
  return redis.error_reply('IN_USE node ' .. id .. ' is alive (its heartbeat is current): stop its kvstashd first')
end
local released = sweep_node_objects(id) + sweep_tier_objects(id)
redis.call('DEL', P .. ':free:' .. id, P .. ':gen:' .. id, P .. ':grant:' .. id)
redis.call('ZREM', P .. ':nodes', id)
redis.call('SREM', P .. ':known', id)
redis.call('HDEL', nk, 'address', 'key')
redis.call('HSET', nk, 'state', 'gone', 'free_pages', 0)
return released

-- deregister_node.lua: the node leaves the cell.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch
-- Returns  OK (also when another epoch holds the id)
--
-- Generations stay, so extents handed out by this incarnation can never match a page of a
-- later one.
-- Uses     call, objects

local id = ARGV[1]
local nk = P .. ':node:' .. id
if redis.call('HGET', nk, 'epoch') ~= ARGV[2] then return 'OK' end
sweep_node_objects(id)
redis.call('DEL', P .. ':free:' .. id, P .. ':grant:' .. id)
redis.call('ZREM', P .. ':nodes', id)
redis.call('HSET', nk, 'state', 'gone', 'free_pages', 0)
return 'OK'

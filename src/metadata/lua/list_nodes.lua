-- list_nodes.lua: the nodes in the cell.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     (none)
-- Returns  the ids of the nodes in the cell (alive or past their deadline, not yet reclaimed)
-- Uses     call

return redis.call('ZRANGE', P .. ':nodes', 0, -1)

-- begin_put.lua: allocates the pages of a new object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, key, size, lease_ms, placement ('spread': most free node first, spilling over
--          nodes; 'one-node [id...]': a copy of an object put with replicas, all on one node
--          while one can hold them, and never on the nodes named, the earlier copies'), then the
--          nodes to avoid: id, pool key, id, pool key...
-- Returns  page_size, extents, the lease's deadline (ms of Redis time: the fence tag of the put's
--          writes at the nodes), then id, address, key per node; NO_SPACE when the pages
--          cannot be found
--
-- The pages come as allocate gives them (prelude, through place_put), from no node the client
-- asks to avoid while others have room. Repeating a begin_put with the same token returns the
-- same pages (a retry after a lost reply).
-- Uses     call, capacity, placement

local one_node, apart = false, {}
for word in string.gmatch(ARGV[5], '[^ ]+') do
  if word == 'one-node' then one_node = true else apart[word] = true end
end
return place_put(ARGV[1], ARGV[2], tonumber(ARGV[3]), 0, ARGV[4], avoid_from_args(6), one_node, apart)

-- begin_put.lua: allocates the pages of a new object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, key, size, lease_ms, then the nodes to avoid: id, pool key, id, pool key...
-- Returns  page_size, extents, the lease's deadline (ms of Redis time: the fence tag of the put's
--          writes at the nodes), then id, address, key per node; NO_SPACE when the pages
--          cannot be found
--
-- The pages come as allocate gives them (prelude, through place_put), from no node the client
-- asks to avoid while others have room. Repeating a begin_put with the same token returns the
-- same pages (a retry after a lost reply).

return place_put(ARGV[1], ARGV[2], tonumber(ARGV[3]), 0, tonumber(ARGV[4]), avoid_from_args(5))

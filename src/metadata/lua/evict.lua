-- evict.lua: makes room on request.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     bytes
-- Returns  objects, pages
--
-- Evicts least recently used unleased objects until that many bytes came free (all or
-- nothing).
-- Uses     call, quotas, capacity, eviction

local ps = page_size()
if ps <= 0 then return {0, 0} end
local objects, pages = evict(math.ceil(tonumber(ARGV[1]) / ps), usable_nodes())
return {objects, pages}

-- begin_put.lua: allocates the pages of a new object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, key, size, lease_ms
-- Returns  page_size, extents, the lease's deadline (ms of Redis time: the fence tag of the put's
--          writes at the nodes), then id, address, key per node; NO_SPACE when the pages
--          cannot be found
--
-- The pages come as allocate (prelude) gives them. Repeating a begin_put with the same token
-- returns the same pages (a retry after a lost reply).

local token, key, size, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pk = P .. ':put:' .. token
local prev = redis.call('HMGET', pk, 'extents', 'nodes')
if prev[1] then
  local deadline = redis.call('ZSCORE', P .. ':pending', token) or '0'
  return endpoints({page_size(), prev[1], deadline}, prev[2])
end
local size_of_page = page_size()
local need = size_of_page > 0 and math.ceil(size / size_of_page) or 0
local ps, extents, nodes = allocate(token, key, size, need, 0, lease)
if not ps then return redis.error_reply(extents) end
return endpoints({ps, extents, now + lease}, nodes)

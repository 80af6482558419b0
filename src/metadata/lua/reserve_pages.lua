-- reserve_pages.lua: a client's page reservation, which its next puts commit from.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, size (bytes of the put it is for), extra (bytes wanted beyond it), lease_ms
-- Returns  page_size, extents, the lease's deadline (ms of Redis time: the fence tag of every
--          write into the reserved pages), then id, address, key per node; NO_SPACE when the
--          needed pages cannot be found
--
-- A put from a reservation costs one round trip (commit_reserved) instead of two. The needed
-- pages (for `size`) come as a put's would (evicting when short); the wanted ones only from free pages
-- (allocate, prelude). The reservation is a pending put of no key: its lease, fence and
-- reclaim are a put's, and the pages no commit took return with it. Repeating a reservation
-- with the same token returns the same pages (a retry after a lost reply).

local token, size, extra, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local pk = P .. ':put:' .. token
local prev = redis.call('HMGET', pk, 'extents', 'nodes')
if prev[1] then
  local deadline = redis.call('ZSCORE', P .. ':pending', token) or '0'
  return endpoints({page_size(), prev[1], deadline}, prev[2])
end
local size_of_page = page_size()
local need, more = 0, 0
if size_of_page > 0 then need, more = math.ceil(size / size_of_page), math.floor(extra / size_of_page) end
local ps, extents, nodes = allocate(token, '', need * size_of_page, need, more, lease)
if not ps then return redis.error_reply(extents) end
return endpoints({ps, extents, now + lease}, nodes)

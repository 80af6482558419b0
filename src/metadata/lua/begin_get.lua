-- begin_get.lua: looks the object up and leases it for reading.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key, reader, lease_ms
-- Returns  page_size, token, size, extents, checksum, layout, the lease's deadline (ms of Redis
--          time), then id, address, key per node; NOT_FOUND
--
-- Of an object put with replicas, the readable copy with the fewest readers is leased.

local o, key = lookup_copy(ARGV[1])
if not o then
  redis.call('HINCRBY', P .. ':stats', 'misses', 1)
  return redis.error_reply('NOT_FOUND no object ' .. ARGV[1])
end
redis.call('HINCRBY', P .. ':stats', 'hits', 1)
local deadline = now + tonumber(ARGV[3])
redis.call('ZADD', P .. ':readers:' .. o[1], deadline, ARGV[2])
redis.call('ZADD', P .. ':lru', now, key)
return endpoints({page_size(), o[1], o[2] or '', o[3] or '', o[4] or '', o[5] or '', deadline}, o[6])

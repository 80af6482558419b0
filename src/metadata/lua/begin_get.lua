-- begin_get.lua: looks the object up and leases it for reading.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key, reader, lease_ms
-- Returns  page_size, token, size, extents, checksum, layout, the lease's deadline (ms of Redis
--          time), then id, address, key per node; NOT_FOUND
--
-- Of an object put with replicas, the readable copy with the fewest readers is leased.

local batch = new_read_batch()
local leased = lease_read(ARGV[1], ARGV[2], tonumber(ARGV[3]), batch)
lease_reads_done(batch)
if not leased then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
return leased

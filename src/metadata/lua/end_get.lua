-- end_get.lua: ends the read lease.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reader, object token, extents read
-- Returns  OK; STALE when the lease had expired or a page was freed or reused meanwhile (the bytes
--          read cannot be trusted)
--
-- A zombie whose last reader left is freed here.

local failed = end_read(ARGV[1], ARGV[2], ARGV[3])
if failed then return redis.error_reply(failed) end
return 'OK'

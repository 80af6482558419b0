-- end_get.lua: ends the read lease.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reader, object token, extents read
-- Returns  OK; STALE when the lease had expired or a page was freed or reused meanwhile (the bytes
--          read cannot be trusted)
--
-- A zombie whose last reader left is freed here.

local tok = ARGV[2]
local rk = P .. ':readers:' .. tok
local deadline = redis.call('ZSCORE', rk, ARGV[1])
redis.call('ZREM', rk, ARGV[1])
local held = deadline and tonumber(deadline) >= now
local fresh = held and current(ARGV[3])
local zk = P .. ':zombie:' .. tok
if redis.call('EXISTS', zk) == 1 and redis.call('ZCOUNT', rk, now, '+inf') == 0 then
  free_extents(redis.call('GET', zk))
  redis.call('DEL', zk, rk)
  redis.call('ZREM', P .. ':zombies', tok)
end
if not held then return redis.error_reply('STALE the read lease expired before the read ended') end
if not fresh then return redis.error_reply('STALE the object\'s pages were reused during the read') end
return 'OK'

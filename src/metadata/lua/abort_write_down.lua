-- abort_write_down.lua: a node gives back the slots of write-downs that failed (the device
-- said EIO or full, or the deadline passed); the objects stay in the pool, untouched.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, then key, slots per object
-- Returns  how many write-downs were still pending (and are no more)
--
-- The node calls it only once the device gave the slots' buffers back (no write of them is
-- still in flight).
-- Uses     call, pages

local n = 0
for i = 2, #ARGV - 1, 2 do
  local ok = P .. ':obj:' .. ARGV[i]
  if redis.call('HGET', ok, 'moving') == ARGV[i + 1] then
    free_extents(ARGV[i + 1])
    redis.call('HDEL', ok, 'moving', 'moving_until')
    n = n + 1
  end
end
return n

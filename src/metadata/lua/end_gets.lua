-- end_gets.lua: ends read leases, many in one run (a store's releaser ends what queued up
-- while its last run was in flight; Catalog::end_get is a run of one).
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reader, object token, extents read (empty: the reader ended it while it held, and
--          needs no check of the pages); repeated per lease
-- Returns  one reply per lease, in order: OK, or STALE and why when the lease had expired or a
--          page was freed or reused meanwhile (the bytes read cannot be trusted)
--
-- A zombie whose last reader left is freed here.
-- Uses     call, pages

-- Ends `reader`'s read lease on object `tok`, whose pages it read as `extents`. Returns nil, or
-- why the bytes read cannot be trusted: the lease expired, or a page was freed or reused while
-- it was held. A zombie whose last reader left is freed here.
local function end_read(reader, tok, extents)
  local rk = P .. ':readers:' .. tok
  local deadline = redis.call('ZSCORE', rk, reader)
  redis.call('ZREM', rk, reader)
  local held = deadline and tonumber(deadline) >= now
  local fresh = held and current(extents)
  local zk = P .. ':zombie:' .. tok
  if redis.call('EXISTS', zk) == 1 and redis.call('ZCOUNT', rk, now, '+inf') == 0 then
    free_extents(redis.call('GET', zk))
    redis.call('DEL', zk, rk)
    redis.call('ZREM', P .. ':zombies', tok)
  end
  if not held then return 'STALE the read lease expired before the read ended' end
  if not fresh then return 'STALE the object\'s pages were reused during the read' end
  return nil
end

local out = {}
for i = 1, #ARGV - 2, 3 do
  out[#out + 1] = end_read(ARGV[i], ARGV[i + 1], ARGV[i + 2]) or 'OK'
end
return out

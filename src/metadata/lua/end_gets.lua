-- end_gets.lua: ends many read leases in one run (a store's releaser ends what queued up
-- while its last run was in flight).
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reader, object token, extents read; repeated per lease
-- Returns  one reply per lease, in order: OK, or a STALE text as end_get's error
--
-- Each lease ends as end_get would end it alone.

local out = {}
for i = 1, #ARGV - 2, 3 do
  out[#out + 1] = end_read(ARGV[i], ARGV[i + 1], ARGV[i + 2]) or 'OK'
end
return out

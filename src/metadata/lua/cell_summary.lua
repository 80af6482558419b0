-- cell_summary.lua: the cell at a glance.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     (none)
-- Returns  page size, objects, now, then the counters of P:stats as field, value

local out = {page_size(), redis.call('ZCARD', P .. ':lru'), now}
for _, v in ipairs(redis.call('HGETALL', P .. ':stats')) do out[#out + 1] = v end
return out

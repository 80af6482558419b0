-- known_nodes.lua: every node the cell knows, live or not, until an operator forgets it.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     (none)
-- Returns  sorted ids
-- Uses     call

local ids = redis.call('SMEMBERS', P .. ':known')
for _, id in ipairs(redis.call('ZRANGE', P .. ':nodes', 0, -1)) do ids[#ids + 1] = id end
table.sort(ids)
local out, last = {}, nil
for _, id in ipairs(ids) do
  if id ~= last then out[#out + 1] = id end
  last = id
end
return out

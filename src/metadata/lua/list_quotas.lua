-- list_quotas.lua: the cell's quotas and what each holds (prelude, "Quotas").
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     (none)
-- Returns  per quota: prefix, gen, max objects, max bytes, objects, bytes, evicted, refused,
--          counting ('1' while its first count is not done, else '0')
-- Uses     call, quotas

local out = {}
for prefix, q in pairs(quotas()) do
  local c = redis.call('HMGET', P .. ':quota:' .. q[1], 'objects', 'bytes', 'evicted', 'refused', 'reserved',
                       'counting')
  out[#out + 1] = prefix
  out[#out + 1] = q[1]
  out[#out + 1] = decimal(q[2])
  out[#out + 1] = decimal(q[3])
  for j = 1, 5 do out[#out + 1] = c[j] or '0' end
  out[#out + 1] = c[6] and '1' or '0'
end
return out

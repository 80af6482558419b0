-- contains_prefix.lua: how much of a key sequence is cached, and where.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     'count' or 'tiers', then keys
-- Returns  how many leading keys are present ('count'); or, per leading key present, in
--          order, 'dram' (in a node's pool) or 'ssd' (on a node's NVMe tier: a get promotes it
--          first, one round trip more) ('tiers')

local tiers = ARGV[1] == 'tiers'
local out = {}
for i = 2, #ARGV do
  local o = lookup_copy(ARGV[i])
  if not o then break end
  if tiers then out[#out + 1] = (o[10] == 'ssd') and 'ssd' or 'dram' end
  if not tiers then out[1] = i - 1 end
end
if tiers then return out end
return out[1] or 0

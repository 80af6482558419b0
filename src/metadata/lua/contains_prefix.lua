-- contains_prefix.lua: how much of a key sequence is cached, and where.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     'count', 'turn', 'tiers' or 'each', then keys
-- Returns  how many leading keys are present ('count'); that, the conversation turn of the
--          request looking them up as turn-ttl counts it (prelude's ttl_turn), and turn-ttl's
--          clock now ('0' under another policy), for the request's hints ('turn'); or, per
--          leading key present, in
--          order, 'dram' (in a node's pool) or 'ssd' (on a node's NVMe tier: a get promotes it
--          first, one round trip more) ('tiers'); or, per key, 1 if present, else 0 ('each':
--          a hybrid model's lookup, whose groups need different chunks)
-- Uses     call, policy, replicas

if ARGV[1] == 'each' then
  local each = {}
  for i = 2, #ARGV do each[i - 1] = lookup_copy(ARGV[i]) and 1 or 0 end
  return each
end
local tiers = ARGV[1] == 'tiers'
if ARGV[1] == 'turn' then
  local keys, count = {}, 0
  for i = 2, #ARGV do keys[i - 1] = ARGV[i] end
  while count < #keys and lookup_copy(keys[count + 1]) do count = count + 1 end
  return {count, ttl_turn(keys, count), policy() == 'turn-ttl' and fmt17(ttl_now()) or '0'}
end
local out = {}
for i = 2, #ARGV do
  local o = lookup_copy(ARGV[i])
  if not o then break end
  if tiers then out[#out + 1] = (o[10] == 'ssd') and 'ssd' or 'dram' end
  if not tiers then out[1] = i - 1 end
end
if tiers then return out end
return out[1] or 0

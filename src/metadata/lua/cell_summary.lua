-- cell_summary.lua: the cell at a glance.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     (none)
-- Returns  page size, objects, now, then the counters of P:stats as field, value, then
--          'tier_objects', the objects on the nodes' NVMe tiers, and 'tier_slots', 'tier_free'
-- Uses     call, pages, quotas, tier

local tier, slots, free = 0, 0, 0
for _, id in ipairs(redis.call('ZRANGE', P .. ':nodes', 0, -1)) do
  local c = tonumber(redis.call('HGET', P .. ':node:' .. slots_of(id), 'page_count') or '0') or 0
  if c > 0 then
    tier = tier + redis.call('ZCARD', P .. ':lru_ssd:' .. id)
    slots = slots + c
    free = free + free_pages(slots_of(id))
  end
end
local out = {page_size(), redis.call('ZCARD', P .. ':lru') + tier, now}
for _, v in ipairs(redis.call('HGETALL', P .. ':stats')) do out[#out + 1] = v end
for _, v in ipairs({'tier_objects', tier, 'tier_slots', slots, 'tier_free', free}) do out[#out + 1] = v end
return out
